"""The planning process's requests and answers as JSON (:mod:`~vramshard.runtime.plan_process`).

Nothing crosses the pipes but JSON: no pickles, no tensors. A request names how to build the model
again (the config.json dict it was built from, its dtype and the names of the sub-layers kept) with a
fingerprint of the model as built here; the child builds it, and refuses to plan for a model whose
fingerprint differs. The plan settings travel as the profile's JSON dict with the factors fitted to
this machine while it ran, and the answer as every field of the :class:`~vramshard.plan.plan_set.PlanSet`.
"""

from __future__ import annotations

import hashlib
import json

from .. import errors
from ..config import parse_dtype
from ..errors import VramshardError
from ..models import build_model
from ..models.base import Model
from ..plan.mechanisms import Mechanisms
from ..plan.memory import VramNeed
from ..plan.placement import Placement
from ..plan.plan_set import PinReason, PlanSet, TierPlan
from ..plan.tiers import Tiers
from ..profile.query import Profile
from .budget import PlanSettings


class WireError(VramshardError):
    """A message of the planning process that cannot be read, or a model the child built otherwise."""


def dumps(message: dict) -> bytes:
    """One message: a line of JSON (infinities allowed: predictions of impossible placements)."""
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def loads(line: bytes) -> dict:
    try:
        message = json.loads(line)
    except ValueError as exc:
        raise WireError(f"not a message of the planning process: {exc}") from None
    if not isinstance(message, dict):
        raise WireError("not a message of the planning process: not a JSON object")
    return message


# --- the model -----------------------------------------------------------------------------

def fingerprint(model: Model) -> str:
    """A hash of everything of ``model`` the planner reads: its hyper-parameters and each
    sub-layer's kind and weights. Kept on the model once made (30 ms of Python for Qwen3-30B-A3B's
    18k weights, on the thread that asks for a plan beside the steps): a model is not changed
    after it is built."""
    known = model.__dict__.get("_wire_fingerprint")
    if known is not None:
        return known
    described = [repr(model.args), str(model.dtype)] + [
        [s.name, s.kind, type(s).__qualname__, s.layer,
         [[w.key, w.source, list(w.shape), str(w.dtype), w.piece] for w in s.weights]] for s in model]
    model.__dict__["_wire_fingerprint"] = hashlib.sha256(json.dumps(described).encode()).hexdigest()
    return model.__dict__["_wire_fingerprint"]


def model_recipe(model: Model) -> dict | None:
    """How the child builds ``model`` again; None where it cannot (a model not built from a
    config.json dict, or one whose dict is not JSON)."""
    if model.config is None:
        return None
    try:
        config = json.loads(json.dumps(model.config))
    except (TypeError, ValueError):
        return None
    return {"config": config, "dtype": str(model.dtype).removeprefix("torch."),
            "sublayers": [s.name for s in model], "fingerprint": fingerprint(model)}


def build_from_recipe(recipe: dict) -> Model:
    """The model of :func:`model_recipe`, checked against its fingerprint (WireError otherwise)."""
    built = build_model(recipe["config"], parse_dtype(recipe["dtype"]))
    by_name = {s.name: s for s in built}
    missing = [name for name in recipe["sublayers"] if name not in by_name]
    if missing:
        raise WireError(f"the model built from its config has no sub-layer(s) {', '.join(missing[:3])}")
    model = Model(built.args, [by_name[name] for name in recipe["sublayers"]], built.dtype, built.config)
    if fingerprint(model) != recipe["fingerprint"]:
        raise WireError("the model built from its config differs from the caller's (another version of vramshard?)")
    return model


# --- the settings ---------------------------------------------------------------------------

def profile_to_wire(profile: Profile) -> dict:
    """The profile's JSON dict, the factors fitted to this machine while it runs, and the engine's
    CPU thread limit."""
    return {"data": profile.to_dict(), "fitted": profile.fitted_factors(), "thread_limit": profile.thread_limit}


def profile_from_wire(data: dict) -> Profile:
    return Profile.from_dict(data["data"]).with_fitted_factors(data["fitted"]).limited_to(data["thread_limit"])


def request(recipe: dict, settings: PlanSettings, budget: int | None, kv_on_gpu: bool | None, search: bool,
            mechanisms: Mechanisms) -> dict:
    return {"model": recipe, "profile": profile_to_wire(settings.profile), "tiers": list(settings.tiers.sizes),
            "context": settings.context, "num_slots": settings.num_slots, "name": settings.name,
            "split_ffns": settings.split_ffns, "kv_split": settings.splits_kv(), "budget": budget,
            "kv_on_gpu": kv_on_gpu, "search": search,
            "mechanisms": mechanisms.to_wire()}


def read_request(message: dict) -> tuple[Model, PlanSettings, int | None, bool | None, bool, Mechanisms]:
    """(model, settings, budget, kv_on_gpu, search, mechanisms) of a :func:`request`."""
    try:
        settings = PlanSettings(profile_from_wire(message["profile"]), Tiers(tuple(message["tiers"])),
                                int(message["context"]), int(message["num_slots"]), message["name"],
                                bool(message["split_ffns"]), bool(message["kv_split"]))
        mechanisms = Mechanisms.from_wire(message["mechanisms"])
        return (build_from_recipe(message["model"]), settings, message["budget"], message["kv_on_gpu"],
                bool(message["search"]), mechanisms)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise WireError(f"a planning request that cannot be read: {type(exc).__name__}: {exc}") from None


# --- the answer -----------------------------------------------------------------------------

def plan_to_wire(plan: PlanSet) -> dict:
    """Every field of ``plan`` (its ``to_dict`` is a report: rounded, and without the placements)."""
    need = plan.need
    return {
        "model_name": plan.model_name, "budget": plan.budget, "context": plan.context, "kv_on_gpu": plan.kv_on_gpu,
        "num_slots": plan.num_slots,
        "need": [need.resident, need.slots, need.kv, need.workspace, need.experts, need.kv_staging],
        "pinned": list(plan.pinned),
        "reasons": [[r.name, r.nbytes, [[t, s] for t, s in r.saved_s.items()], r.score] for r in plan.reasons],
        "tiers": [{"tier": t.tier, "family": t.family, "placement": t.placement.to_data(), "threads": t.threads,
                   "predicted_s": t.predicted_s, "candidates": t.candidates,
                   "placements": {f: p.to_data() for f, p in t.placements.items()},
                   "zero_copy_cpu_share": t.zero_copy_cpu_share, "cpu_packed": t.cpu_packed}
                  for t in plan.tiers.values()],
        "notes": list(plan.notes), "expert_cache": plan.expert_cache, "expert_hit_rate": plan.expert_hit_rate,
        "worker_team": plan.worker_team, "kv_layers_in_vram": plan.kv_layers_in_vram,
        "pinned_weight_bytes": plan.pinned_weight_bytes,
    }


def plan_from_wire(data: dict) -> PlanSet:
    try:
        tiers = {}
        for t in data["tiers"]:
            tiers[int(t["tier"])] = TierPlan(
                int(t["tier"]), t["family"], Placement.from_data(t["placement"]), t["threads"], float(t["predicted_s"]),
                {f: float(s) for f, s in t["candidates"].items()},
                {f: Placement.from_data(p) for f, p in t["placements"].items()},
                float(t["zero_copy_cpu_share"]), bool(t["cpu_packed"]))
        return PlanSet(
            data["model_name"], data["budget"], int(data["context"]), bool(data["kv_on_gpu"]), int(data["num_slots"]),
            VramNeed(*(int(b) for b in data["need"])), list(data["pinned"]),
            [PinReason(name, int(nbytes), {int(t): float(s) for t, s in saved}, float(score))
             for name, nbytes, saved, score in data["reasons"]],
            tiers, list(data["notes"]), int(data["expert_cache"]), float(data["expert_hit_rate"]), data["worker_team"],
            data["kv_layers_in_vram"], int(data.get("pinned_weight_bytes", 0)))
    except (KeyError, TypeError, ValueError) as exc:
        raise WireError(f"a plan from the planning process that cannot be read: {type(exc).__name__}: {exc}") from None


def error_to_wire(exc: BaseException) -> dict:
    return {"error": type(exc).__name__, "message": str(exc)}


def error_from_wire(data: dict) -> VramshardError:
    """The planner's error as raised there: one of vramshard's errors by name, else a WireError
    that names it."""
    cls = getattr(errors, str(data.get("error")), None)
    message = str(data.get("message"))
    if isinstance(cls, type) and issubclass(cls, VramshardError):
        return cls(message)
    return WireError(f"the planner failed in the planning process: {data.get('error')}: {message}")
