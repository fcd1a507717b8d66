"""Measuring one engine of one report cell: the systems compared, TTFT under a time cap, the
physical bound and the estimator's prediction. Decode timing is executor_bench's."""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from dataclasses import dataclass, field

import torch

from vramshard.errors import BudgetError, VramshardError
from vramshard.layers.moe import MoEFFN
from vramshard.layers.step import Step
from vramshard.plan.estimator import Estimator
from vramshard.plan.memory import (expert_slot_bytes, main_piece_bytes, max_resident_layers, moe_layers,
                                   sublayer_packed_bytes, sublayer_triples)
from vramshard.plan.placement import Placement, TieredPlacement, named_placement
from vramshard.plan.planner import PlanSet, Planner
from vramshard.plan.tiers import Tiers
from vramshard.runtime.executor import Executor
from vramshard.runtime.host_weights import HostLayouts

from ..common import sync
from ..executor_bench import decode_seconds

log = logging.getLogger("report")
GiB = 2**30
TIERS = (1, 4, 16, 64, 256, 512, 1024, 2048)


@dataclass
class System:
    """One engine of a cell: the planned one, a baseline, or the unconstrained GPU run."""

    label: str  # "vramshard", "layers:max", "experts-cpu", "unconstrained"
    placement: TieredPlacement | Placement | None
    error: str | None = None
    plan: PlanSet | None = None
    expert_cache: int | None = None
    options: dict = field(default_factory=dict)  # the Executor's, e.g. the baseline's CPU-computed experts

    @property
    def tiered(self) -> TieredPlacement:
        p = self.placement
        return p if isinstance(p, TieredPlacement) else TieredPlacement.single(p)


def systems_for(model, budget: int, kv_tokens: int, max_tokens: int, profile, kv_slots: int = 1) -> list[System]:
    """The planned engine and the baselines at one budget: ``layers:max`` (the most whole layers
    that fit, what ``-ngl N`` does) and, for MoE models, ``experts-cpu`` (``--cpu-moe``), each for
    ``kv_slots`` sequences of up to ``kv_tokens`` tokens."""
    triples, layers = sublayer_triples(model), model.args.num_hidden_layers
    out = []
    tiers = Tiers(tuple(t for t in TIERS if t <= max_tokens) or (max_tokens,))
    try:
        plan = Planner(model, profile, budget, context=kv_tokens, tiers=tiers, kv_slots=kv_slots).plan()
        out.append(System("vramshard", plan.tiered(), plan=plan, expert_cache=plan.expert_cache or None))
    except BudgetError as exc:
        out.append(System("vramshard", None, error=str(exc)))
    most = max_resident_layers(model, budget, kv_slots, kv_tokens, max_tokens)
    out.append(System("layers:max", named_placement("layers:max", triples, layers, most)))
    moe = moe_layers(model)
    if moe:
        # --cpu-moe: the experts computed by the CPU (not read by the GPU's zero-copy kernels)
        out.append(System("experts-cpu", named_placement("experts-cpu", triples, layers, moe_layers=moe),
                          options={"experts_zero_copy": False}))
    return out


def unconstrained(model) -> System:
    """Every sub-layer resident in VRAM, no budget: the GPU reference."""
    return System("unconstrained", named_placement("gpu", sublayer_triples(model), model.args.num_hidden_layers))


def decode_bound_tok_s(model, budget: int | None, bandwidth: dict) -> float | None:
    """Physical bound of one decode step (tokens/s) under ``budget`` bytes of VRAM.

    The bytes a step reads that are not in VRAM must cross PCIe or be read by the CPU, so
    step time >= those bytes / (PCIe H2D + CPU read bandwidth), and >= those bytes / what host
    memory gives both at once (``shared_total``, when measured): the smaller bandwidth counts.
    The best use of the budget pins
    the bytes every token reads (attention, dense FFNs, MoE routers, the head) first, then
    experts, which under uniform routing save the cached fraction of the routed expert bytes.
    The embedding reads one row per token and is left out; KV and workspace VRAM are left out
    too, which only raises the bound. None: the budget holds everything a step reads.
    """
    if budget is None:
        return None
    moe = [s for s in model if isinstance(s, MoEFFN)]
    slot = expert_slot_bytes(model) if moe else 0
    routed = sum(s.top_k * slot for s in moe)
    expert_total = sum(s.num_experts * slot for s in moe)
    every_token = sum(sublayer_packed_bytes(model, s.name) for s in model
                      if s.kind != "embed" and not isinstance(s, MoEFFN))
    every_token += sum(main_piece_bytes(model, s.name) for s in moe)
    room = max(0, budget - every_token)
    hit = min(1.0, room / expert_total) if expert_total else 1.0
    missed = max(0, every_token - budget) + routed * (1 - hit)
    if missed <= 0:
        return None
    rate = bandwidth["h2d"] + bandwidth["cpu_read"]
    if bandwidth.get("shared_total"):
        rate = min(rate, bandwidth["shared_total"])
    return rate * 1e9 / missed


@torch.inference_mode()
def prefill_ttft(executor: Executor, prompt: int, chunk: int, cap_s: float) -> dict:
    """Time to first token of a ``prompt``-token prompt read in ``chunk``-token steps.

    One short warm-up chunk first. Once the time so far, scaled to the whole prompt, passes
    ``cap_s``, the rest is extrapolated from the chunks measured: a lower bound, since later
    chunks attend to more context (``ttft_estimated``)."""
    kv = executor.new_kv_cache(1, prompt + 1)
    ids = torch.randint(0, min(1000, executor.model.args.vocab_size), (prompt,))
    warm = min(chunk, 128, prompt)
    executor.forward(ids[:warm], Step.single(0, warm, kv_lookup=kv))
    sync()
    done = 0
    start = time.perf_counter()
    while done < prompt:
        n = min(chunk, prompt - done)
        executor.forward(ids[done:done + n], Step.single(done, n, kv_lookup=kv))
        sync()
        done += n
        if done < prompt and (time.perf_counter() - start) * prompt / done > cap_s:
            break
    elapsed = time.perf_counter() - start
    return {"ttft_s": elapsed * prompt / done, "ttft_estimated": done < prompt, "ttft_measured_tokens": done}


def predicted_s(model, profile, system: System, n_tokens: int, context: int) -> float:
    """The estimator's seconds for one step of ``n_tokens`` new tokens at ``context`` under the
    system's placement for that many tokens (with the plan's expert hit rate)."""
    placement, threads = system.tiered.for_tokens(n_tokens)
    hit = system.plan.expert_hit_rate if system.plan is not None else 0.0
    return Estimator(model, profile, threads=threads, expert_hit_rate=hit).simulate(placement, n_tokens,
                                                                                    context).seconds


def predicted(model, profile, system: System, context: int, prompt: int, chunk: int) -> dict:
    """The estimator's decode step (ms) at ``context`` and TTFT (s) of ``prompt`` tokens read in
    ``chunk``-token steps; a failed prediction is recorded, the measurement still counts."""
    out = {}
    try:
        out["predicted_step_ms"] = predicted_s(model, profile, system, 1, context) * 1e3
        out["predicted_ttft_s"] = sum(predicted_s(model, profile, system, min(chunk, prompt - begin),
                                                  begin + min(chunk, prompt - begin))
                                      for begin in range(0, prompt, chunk))
    except Exception as exc:  # noqa: BLE001 - any estimator failure is reported, not fatal
        log.warning("prediction failed for %s: %s", system.label, exc)
        out["prediction_error"] = f"{type(exc).__name__}: {exc}"
    if system.plan is not None:
        out["planner_predicted_ms"] = system.plan.tiers[min(system.plan.tiers)].predicted_s * 1e3
    return out


def plan_name(plans: TieredPlacement) -> str:
    """Short name of a (tiered) placement: 'layers:9', or 'static@1-64, gpu-only@256-1024'."""
    if len(plans.placements) == 1:
        return plans.placements[0].name
    runs: list[list] = []
    for tier, placement in zip(plans.tiers, plans.placements):
        family = placement.name.split("@")[0]
        if runs and runs[-1][0] == family:
            runs[-1][2] = tier
        else:
            runs.append([family, tier, tier])
    return ", ".join(f"{f}@{a}" if a == b else f"{f}@{a}-{b}" for f, a, b in runs)


def host_for(host, placement) -> dict:
    """The packed weights ``placement`` runs on: from a :class:`HostLayouts` the layout it needs,
    else ``host`` itself."""
    return host.for_placement(placement) if isinstance(host, HostLayouts) else host


def run_cell(model, host, system: System, budget: int | None, context: int, settings, profile) -> dict:
    """Decode tok/s at ``context`` tokens of context and TTFT of a ``context``-token prompt for one
    engine; errors (budget refusals, CUDA OOM) come back in the cell as ``error``."""
    cell = {"system": system.label, "budget_gib": budget / GiB if budget else None, "context": context}
    if system.error:
        cell["error"] = system.error
        return cell
    kv_tokens = context + settings.chunk + 16
    gc.collect()
    torch.cuda.empty_cache()
    try:
        executor = Executor(model, host_for(host, system.tiered), system.tiered, budget=budget,
                            max_tokens=settings.chunk,
                            max_context=kv_tokens, expert_cache=system.expert_cache, **system.options)
    except VramshardError as exc:
        cell["error"] = str(exc)
        return cell
    except torch.cuda.OutOfMemoryError as exc:
        cell["error"] = f"CUDA out of memory while loading: {str(exc).splitlines()[0]}"
        return cell
    with errors_into(cell):
        cell["placement"] = plan_name(executor.plans)
        cell["resident_gib"] = executor.need.resident / GiB
        cell["vram_plan_gib"] = executor.need.total / GiB
        cache = executor.expert_cache
        before = cache.stats.copy() if cache is not None else None
        step = decode_seconds(executor, context, settings.decode_steps)
        cell["decode_step_ms"] = step * 1e3
        cell["decode_tok_s"] = 1 / step
        cell["decode_bytes_streamed"] = executor.report.bytes_streamed
        if before is not None:  # over the decode steps that asked the cache (the zero-copy kernels'
            stats = cache.stats.minus(before)  # steps read it by table and count nothing)
            if stats.hits + stats.misses:
                cell.update(expert_hit_rate=stats.hit_rate, expert_asked=stats.hits + stats.misses)
        cell.update(prefill_ttft(executor, context, settings.chunk, settings.ttft_cap_s))
        cell.update(predicted(model, profile, system, context, context, settings.chunk))
        peak = executor.peak_vram()
        cell["peak_vram_gib"] = peak / GiB
        cell["within_budget"] = budget is None or peak <= budget
    del executor
    gc.collect()
    torch.cuda.empty_cache()
    return cell


@contextlib.contextmanager
def errors_into(cell: dict):
    """Inside: one cell's measurement; an out-of-memory or a refusal ends it as the cell's ``error``."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as exc:
        cell["error"] = f"CUDA out of memory: {str(exc).splitlines()[0]}"
    except VramshardError as exc:
        cell["error"] = str(exc)
