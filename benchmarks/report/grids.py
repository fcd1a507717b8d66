"""The GPU side of the dense (Table 4) and batch (Table 9) parts: build the model once, then
every cell of the part's budgets, each written as soon as it is measured."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

from vramshard.config import parse_dtype
from vramshard.errors import VramshardError
from vramshard.models import build_model
from vramshard.plan.memory import moe_layers
from vramshard.runtime.executor import Executor
from vramshard.runtime.host_weights import HostLayouts, pack_model
from vramshard.shapes import random_weights, shape_config

from ..common import Deadline, cpu_read_bandwidth, h2d_bandwidth, shared_read_bandwidth
from ..engine_bench import device_bandwidth, planner_profile
from ..moe_bench import batched_tok_s, random_packed
from .measure import GiB, decode_bound_tok_s, errors_into, host_for, plan_name, predicted_s, run_cell, systems_for, unconstrained
from .parts import Part
from .record import PartRecord

log = logging.getLogger("report")


@dataclass
class Settings:
    """How each cell is measured (the part's JSON records these)."""

    chunk: int = 1024  # prompt tokens per step, and the executor's largest step
    decode_steps: int = 5
    ttft_cap_s: float = 15.0  # TTFT beyond this is extrapolated (see measure.prefill_ttft)
    cell_reserve_s: float = 45.0  # no cell starts with less than this left before the deadline
    batch_ctx: int = 64  # context of each sequence in the batch grid
    batch_steps: int = 3  # timed steps of a batch cell, at least (see steps_for)
    batch_min_tokens: int = 16  # ... and at least this many tokens: a one-sequence cell's median of 3
    # steps came out 1.6x its Table 4 decode step in the same call (twenty-second GPU session)
    layers: int | None = None  # cut the model to N layers (smoke tests)
    shape: str | None = None  # another shape than the part's (smoke tests)
    profile: str | None = None  # machine profile for the planner; default stored, else fitted here
    images: tuple[str, ...] | None = None  # VLM parts: resolutions (default all of vlm_bench's)
    option_sets: tuple[str, ...] | None = None  # VLM parts: vision option sets (default all)
    vlm_decode: int = 16  # VLM parts: tokens decoded where the 128-token answer is extrapolated


def build(part: Part, settings: Settings):
    """(model, pinned packed host weights, build seconds) of the part's shape with random weights."""
    config = shape_config(settings.shape or part.model)
    if settings.layers:
        config["num_hidden_layers"] = settings.layers
    dtype = parse_dtype(part.dtype) if part.dtype and not settings.shape else None
    model = build_model(config, dtype)
    t0 = time.perf_counter()
    # MoE: made on the GPU piece by piece straight into pinned buffers (no second 57 GiB host copy).
    host = random_packed(model) if moe_layers(model) else \
        pack_model(list(model), random_weights(model), pin=True, splittable=False)
    # Plans that split dense FFNs get the split layout (made on first need), the others this one.
    return model, HostLayouts(list(model), host), time.perf_counter() - t0


def setup(part: Part, record: PartRecord, settings: Settings):
    """Bandwidths, the model and the planner's profile, recorded; returns (model, host, profile, bw)."""
    shared = shared_read_bandwidth()
    bandwidth = {"h2d": h2d_bandwidth() / 1e9, "cpu_read": cpu_read_bandwidth() / 1e9,
                 "device": device_bandwidth() / 1e9, "shared_total": shared["total"] / 1e9}
    model, host, build_s = build(part, settings)
    profile, source = planner_profile(settings.profile, bandwidth, {model.dtype})
    record.set(bandwidth_gb_s=bandwidth, profile=source, build_s=build_s, model_bytes=model.nbytes,
               dtype=str(model.dtype).replace("torch.", ""), layers=model.args.num_hidden_layers)
    log.info("%s: %.1f GiB built in %.0f s; bandwidth %s; profile %s", part.model, model.nbytes / GiB, build_s,
             bandwidth, source)
    return model, host, profile, bandwidth


def skipped(cell: dict, deadline: Deadline) -> dict:
    return {**cell, "skipped": f"part time limit: {deadline.limit_s:.0f} s spent before this cell"}


def run_dense(part: Part, record: PartRecord, settings: Settings, deadline: Deadline) -> None:
    """Table 4: per budget and context, the planned engine, the baselines, the physical bound;
    the unconstrained run once per context."""
    model, host, profile, bandwidth = setup(part, record, settings)
    for context in part.contexts:
        cell = {"system": "unconstrained", "budget_gib": None, "context": context}
        if deadline.left() < settings.cell_reserve_s:
            record.add(skipped(cell, deadline))
            continue
        record.add(run_cell(model, host, unconstrained(model), None, context, settings, profile))
        log.info("%s", record.cells[-1])
    for budget_gib in part.budgets:
        budget = int(budget_gib * GiB)
        for context in part.contexts:
            record.add({"system": "bound", "budget_gib": budget_gib, "context": context,
                        "decode_tok_s": decode_bound_tok_s(model, budget, bandwidth)})
            kv_tokens = context + settings.chunk + 16
            try:
                systems = systems_for(model, budget, kv_tokens, settings.chunk, profile)
            except VramshardError as exc:
                record.add({"system": "vramshard", "budget_gib": budget_gib, "context": context, "error": str(exc)})
                continue
            for system in systems:
                if deadline.left() < settings.cell_reserve_s:
                    record.add(skipped({"system": system.label, "budget_gib": budget_gib, "context": context},
                                       deadline))
                    continue
                record.add(run_cell(model, host, system, budget, context, settings, profile))
                log.info("%s", record.cells[-1])


def run_batch(part: Part, record: PartRecord, settings: Settings, deadline: Deadline) -> None:
    """Table 9 / Figure 7: batched decode tokens/s at each batch size, budget and engine."""
    model, host, profile, _ = setup(part, record, settings)
    largest = max(part.batch_sizes)
    per_seq = batch_context(settings)
    for budget_gib in part.budgets:
        budget = int(budget_gib * GiB)
        systems = batch_systems(model, budget, part.batch_sizes, settings, profile)
        for system in systems:
            for batch in part.batch_sizes:
                cell = {"system": system.label, "budget_gib": budget_gib, "batch": batch,
                        "context": settings.batch_ctx}
                if system.error:
                    record.add({**cell, "error": system.error})
                    continue
                if deadline.left() < settings.cell_reserve_s / 3:
                    record.add(skipped(cell, deadline))
                    continue
                record.add(batch_cell(model, host, system, budget, batch, per_seq, largest, settings, profile, cell))
                log.info("%s", record.cells[-1])


def steps_for(settings: Settings, batch: int) -> int:
    """Timed steps of a batch cell: ``batch_steps``, more for small batches so that every cell
    decodes at least ``batch_min_tokens`` tokens (16 steps at batch 1, 4 at batch 4, 3 above)."""
    return max(settings.batch_steps, -(-settings.batch_min_tokens // batch))


def batch_context(settings: Settings) -> int:
    """Tokens of KV cache each sequence of the batch grid holds: its context, the steps timed, slack."""
    return settings.batch_ctx + steps_for(settings, 1) + 8


def batch_systems(model, budget: int, batch_sizes, settings: Settings, profile) -> list:
    """The engines of one budget of the batch grid, each planned once for the largest batch, as a
    server sized for it would be: that many sequences' KV cache (each rounded up to whole blocks)
    and that many rows of workspace."""
    largest = max(batch_sizes)
    return systems_for(model, budget, batch_context(settings), largest, profile, kv_slots=largest)


def batch_cell(model, host, system, budget, batch, per_seq, largest, settings, profile, cell) -> dict:
    """Batched decode tok/s of ``batch`` sequences at ``settings.batch_ctx`` tokens of context (moe_bench's
    timing), with the estimator's step time for the same shape."""
    try:
        executor = Executor(model, host_for(host, system.tiered), system.tiered, budget=budget,
                            max_tokens=largest, max_context=per_seq,
                            kv_slots=batch, expert_cache=system.expert_cache, **system.options)
    except VramshardError as exc:
        return {**cell, "error": str(exc)}
    with errors_into(cell):
        cell["placement"] = plan_name(executor.plans)
        tok_s = batched_tok_s(executor, batch, settings.batch_ctx, steps_for(settings, batch))
        cell.update(tok_s=tok_s, step_ms=batch / tok_s * 1e3, peak_vram_gib=executor.peak_vram() / GiB)
        cell["within_budget"] = executor.peak_vram() <= budget
        try:
            cell["predicted_step_ms"] = predicted_s(model, profile, system, batch, settings.batch_ctx) * 1e3
        except Exception as exc:  # noqa: BLE001 - any estimator failure is reported, not fatal
            cell["prediction_error"] = f"{type(exc).__name__}: {exc}"
    del executor
    return cell


def settings_dict(settings: Settings) -> dict:
    return asdict(settings)
