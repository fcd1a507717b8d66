"""What the planner decides, as plain data: per token tier the winning placement with every
family's prediction, the pinned set with the reasons for it, and the VRAM it needs."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from .memory import VramNeed
from .placement import Placement, TieredPlacement

# Tiers up to which the run-ahead worker computes with the profile's fastest team (Profile.worker_team,
# timed at one token); at more rows a dense part's products are compute-bound and take every core.
WORKER_TEAM_ROWS = 16


@dataclass
class PinReason:
    name: str
    nbytes: int
    saved_s: dict[int, float]  # tier -> seconds per step saved by keeping it in VRAM
    score: float  # relative step time saved per GiB, summed over tiers


@dataclass
class TierPlan:
    tier: int
    family: str
    placement: Placement
    threads: int | None
    predicted_s: float
    candidates: dict[str, float]  # family -> predicted seconds per step (inf: not possible)
    placements: dict[str, Placement] = field(default_factory=dict, repr=False)  # family -> its placement
    # Of a decode step's host experts read by the GPU's zero-copy kernels, the CPU's share (0: none).
    zero_copy_cpu_share: float = 0.0
    # Dense FFNs' CPU work from weights prepacked for oneDNN (where the profile finds that faster).
    cpu_packed: bool = False


@dataclass
class PlanSet:
    """Everything the planner decided, as plain data."""

    model_name: str
    budget: int | None
    context: int
    kv_on_gpu: bool  # whether VRAM holds KV caches: all of them, or those of kv_layers_in_vram layers
    num_slots: int
    need: VramNeed
    pinned: list[str]
    reasons: list[PinReason]
    tiers: dict[int, TierPlan]
    notes: list[str] = field(default_factory=list)
    expert_cache: int = 0  # bytes of the VRAM expert cache (MoE placements that cache experts)
    expert_hit_rate: float = 0.0  # the hit rate the estimator assumed for it
    # The run-ahead worker's OpenMP team in tiers of up to WORKER_TEAM_ROWS tokens (None: the default).
    worker_team: int | None = None
    # Where only some layers' KV caches are in VRAM (those of the attention layers pinned there), how many;
    # None: all of them where kv_on_gpu, else none.
    kv_layers_in_vram: int | None = None
    pinned_weight_bytes: int = 0  # packed bytes of the pinned weights (more than need.resident where pins are coded)

    @property
    def kv_side(self) -> str:
        """Where the KV cache lives, in words ("on the GPU", "on the CPU", or split by layer)."""
        if self.kv_layers_in_vram is not None:
            layers = "layer" if self.kv_layers_in_vram == 1 else "layers"
            return (f"in VRAM for the {self.kv_layers_in_vram} attention {layers} pinned there, in host memory "
                    "for the others")
        return "on the GPU" if self.kv_on_gpu else "on the CPU"

    @property
    def coded_names(self) -> list[str]:
        """Pinned sub-layers kept coded in VRAM (``Where.coded``; the same at every tier)."""
        return self.tiers[min(self.tiers)].placement.coded_names() if self.tiers else []

    def tiered(self) -> TieredPlacement:
        sizes = tuple(sorted(self.tiers))
        named = tuple(Placement(f"{self.tiers[s].family}@{s}", self.tiers[s].placement.where) for s in sizes)
        shares = tuple(self.tiers[s].zero_copy_cpu_share for s in sizes)
        teams = tuple(self.worker_team if s <= WORKER_TEAM_ROWS else None for s in sizes) if self.worker_team else ()
        return TieredPlacement(sizes, named, tuple(self.tiers[s].threads for s in sizes), self.expert_cache,
                               shares if any(shares) else (), teams, tuple(self.tiers[s].cpu_packed for s in sizes))

    def holds_vram_as(self, other: "PlanSet") -> bool:
        """Whether this plan lays out VRAM as ``other`` does: the same sub-layers pinned in the same order,
        the same slots, KV side, expert cache and worker team; a placement of either at any tier then
        runs over the other's buffers as they lie."""
        return (self.pinned == other.pinned and self.need == other.need and self.num_slots == other.num_slots
                and self.kv_on_gpu == other.kv_on_gpu and self.kv_layers_in_vram == other.kv_layers_in_vram
                and self.expert_cache == other.expert_cache and self.worker_team == other.worker_team
                and self.budget == other.budget and self.context == other.context
                and set(self.tiers) == set(other.tiers))

    def with_tiers_of(self, other: "PlanSet", tiers) -> "PlanSet":
        """This plan with ``other``'s plans at ``tiers`` (both must hold VRAM alike: :meth:`holds_vram_as`)."""
        if not self.holds_vram_as(other):
            raise ValueError("plans that lay out VRAM differently cannot share their tiers' placements")
        return dataclasses.replace(self, tiers={tier: other.tiers[tier] if tier in tiers else plan
                                                for tier, plan in self.tiers.items()})

    def to_dict(self) -> dict:
        return {
            "model": self.model_name, "budget": self.budget, "context": self.context, "kv_on_gpu": self.kv_on_gpu,
            "kv_layers_in_vram": self.kv_layers_in_vram,
            "num_slots": self.num_slots,
            "vram": {"resident": self.need.resident, "slots": self.need.slots, "kv": self.need.kv,
                     "workspace": self.need.workspace, "experts": self.need.experts,
                     "kv_staging": self.need.kv_staging, "total": self.need.total},
            "expert_cache": self.expert_cache, "expert_hit_rate": self.expert_hit_rate,
            "worker_team": self.worker_team, "coded": self.coded_names, "pinned_weight_bytes": self.pinned_weight_bytes,
            "pinned": [{"name": r.name, "bytes": r.nbytes, "score": r.score,
                        "saved_ms": {str(t): s * 1e3 for t, s in r.saved_s.items()}} for r in self.reasons],
            "tiers": {str(t): {"family": p.family, "threads": p.threads, "predicted_ms": p.predicted_s * 1e3,
                               "zero_copy_cpu_share": p.zero_copy_cpu_share, "cpu_packed": p.cpu_packed,
                               "tok_s": t / p.predicted_s if p.predicted_s else None,
                               "candidates_ms": {k: (v * 1e3 if math.isfinite(v) else None)
                                                 for k, v in p.candidates.items()},
                               "placement": [[n, *w.to_list()] for n, w in p.placement.where]}
                      for t, p in self.tiers.items()},
            "notes": self.notes,
        }
