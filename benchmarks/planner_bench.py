"""Planner benchmark: predicted vs measured step time per family, on real shapes.

    PYTHONPATH=src python -m benchmarks.planner_bench --models nemo-8b,llama3-8b --budgets 2,4,8

For each model and budget the planner plans tiers 1, 16, 64 and 512 from this machine's
profile (``--profile PATH``, else a quick profile measured first, in the same run). Each
family's placement is then run by the executor and timed:

- decode tier t: t sequences of one new token each, each with ``ctx // t`` tokens of context
  (at most ``--seq-ctx``), so the KV reserved (``--ctx`` tokens in all) serves every tier;
- prompt tier t (t > 64): one chunk of t prompt tokens.

Every executor is made as an engine makes one: decode steps replayed from CUDA graphs where there is a GPU, as
the plans price them.

Families predicted slower than ``--measure-within`` times the winner are not run (said so).
``--calibrate``: per cell, the engine's in-situ calibration closed on the GPU: the profile fitted
to the chosen plan's measured step, a new plan with it, its prediction, then its measurement.
Also in the same run: the best ``layers:N`` baseline at tier 1, and the physical bound of a
decode step, (model bytes − embedding − pinned bytes) / bandwidth, with the smaller of two bandwidths
measured here: PCIe + CPU read, each alone (``additive_bound_tok_s``), and what host memory
gives both when they read at once (``shared_bound_tok_s``, :func:`shared_read_bandwidth`).
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import time

import torch

from vramshard.errors import BudgetError
from vramshard.layers.step import Step
from vramshard.plan.calibrate import fit, fit_measured
from vramshard.plan.memory import max_resident_layers, sublayer_triples
from vramshard.plan.placement import TieredPlacement, named_placement
from vramshard.plan.planner import Planner
from vramshard.plan.tiers import Tiers
from vramshard.runtime.executor import Executor
from vramshard.runtime.host_weights import HostLayouts, pack_model
from vramshard.runtime.wire_codec import wire_ratio
from vramshard.shapes import random_weights, shape_model

from .common import (coded_link, cpu_read_bandwidth, decode_read_bytes, h2d_bandwidth, hardware, now, out_dir,
                     shared_read_bandwidth, timed, write_json)

log = logging.getLogger("planner_bench")
GiB = 2**30


def engine_executor(model, host, placement, budget: int, max_tokens: int, max_context: int) -> Executor:
    """An executor as an engine makes one for ``placement``: decode steps replayed from CUDA graphs where there is a
    GPU (the plans price them so: :func:`~vramshard.plan.mechanisms.decode_graphs_enabled`)."""
    return Executor(model, host, placement, budget=budget, max_tokens=max_tokens, max_context=max_context,
                    decode_graphs=torch.cuda.is_available())


def step_seconds(executor: Executor, tier: int, ctx: int, seq_ctx: int) -> float:
    """Median seconds of one step of the tier's shape (see the module docstring)."""
    return step_and_cpu_seconds(executor, tier, ctx, seq_ctx)[0]


def step_and_cpu_seconds(executor: Executor, tier: int, ctx: int, seq_ctx: int) -> tuple[float, float]:
    """(median seconds of one step of the tier's shape, median host seconds of its CPU work:
    ``StepReport.host_compute_s``, the executor's own timing)."""
    cpu: list[float] = []

    def forward(ids, step):
        executor.forward(ids, step)
        cpu.append(executor.report.host_compute_s)

    if tier <= 64:
        per_seq = min(seq_ctx, ctx // tier - 8)
        kv = executor.new_kv_cache(tier, per_seq + 8)
        kv.fill_random(per_seq)
        tokens = torch.full((tier,), 11)
        state = {"pos": per_seq}

        def one():
            forward(tokens, Step(list(range(tier)), [state["pos"]] * tier, [1] * tier, list(range(tier)), kv_lookup=kv))
            state["pos"] += 1

        warmup, seconds = 2, timed(one, repeat=5, warmup=2, budget_s=15)
    else:
        kv = executor.new_kv_cache(1, tier + 1)
        ids = torch.randint(0, 1000, (tier,))
        warmup, seconds = 1, timed(lambda: forward(ids, Step.single(0, tier, kv_lookup=kv)), repeat=3, warmup=1,
                                   budget_s=20)
    timed_cpu = cpu[warmup:] or cpu  # the timed steps' (all, if the time budget cut the warm-up short)
    return seconds, statistics.median(timed_cpu) if timed_cpu else 0.0


def run_model(name: str, args, profile, bw, on_cell=None, deadline: float | None = None) -> dict:
    """Every (budget, tier) cell of one model: ``{"bytes", "cells", "skipped"}``. ``on_cell(entry)``
    gets that dict after each cell (so a caller can write what is done); no cell starts after
    ``deadline`` (``time.perf_counter()``), and the cells left out are named in ``skipped``."""
    model = shape_model(name)
    t0 = time.perf_counter()
    # Placements that split dense FFNs run on the split layout, all others on the checkpoint's.
    host = HostLayouts(list(model), pack_model(list(model), random_weights(model), pin=True, splittable=False))
    log.info("%s built and pinned in %.1f s", name, time.perf_counter() - t0)
    tiers = Tiers(tuple(int(t) for t in args.tiers.split(",")))
    cells: list[dict] = []
    entry = {"bytes": model.nbytes, "cells": cells, "skipped": []}
    for budget_gib in (float(b) for b in args.budgets.split(",")):
        if deadline is not None and time.perf_counter() > deadline:
            entry["skipped"] += [f"{budget_gib:g} GiB tier {t}" for t in tiers.sizes]
            continue
        budget = int(budget_gib * GiB)
        plan = Planner(model, profile, budget, context=args.ctx, tiers=tiers, name=name).plan()
        pinned_bytes = plan.need.resident
        # Host weight bytes a decode step reads, one way or the other (the embedding is a gather of one row per token).
        streamed_or_read = max(decode_read_bytes(model) - pinned_bytes, 1)
        link = coded_link(bw, wire_ratio(model.dtype))  # (raw bytes the link carries: coded fills carry more)
        additive = (link["h2d"] + link["cpu_read"]) / streamed_or_read
        shared = link["shared_total"] / streamed_or_read
        bound = min(additive, shared)
        for tier, tier_plan in sorted(plan.tiers.items()):
            if deadline is not None and time.perf_counter() > deadline:
                entry["skipped"].append(f"{budget_gib:g} GiB tier {tier}")
                continue
            cell = {"model": name, "budget_gib": budget_gib, "tier": tier, "chosen": tier_plan.family,
                    "threads": tier_plan.threads, "kv_on_gpu": plan.kv_on_gpu, "pinned_gib": pinned_bytes / GiB,
                    "predicted_ms": {}, "measured_ms": {}, "skipped": {}}
            best_predicted = tier_plan.predicted_s
            # Families that produce the same placement (static and cpu when the KV cache is on
            # the host, search when it finds nothing better) are one plan: measure it once, so
            # that run-to-run noise cannot rank a plan against itself.
            families = sorted(tier_plan.placements, key=lambda f: f != tier_plan.family)
            measured_as: dict[tuple, str] = {}
            for family in families:
                placement = tier_plan.placements[family]
                predicted = tier_plan.candidates[family]
                cell["predicted_ms"][family] = predicted * 1e3
                if predicted > args.measure_within * best_predicted:
                    cell["skipped"][family] = f"predicted {predicted / best_predicted:.1f}x the winner"
                    continue
                threads = tier_plan.threads if family == tier_plan.family else None
                same = measured_as.get((placement.where, threads))
                if same is not None:
                    cell["same_plan_as"] = {**cell.get("same_plan_as", {}), family: same}
                    continue
                measured_as[(placement.where, threads)] = family
                tiered = TieredPlacement((tier,), (placement,), (threads,), plan.expert_cache)
                gc.collect()
                torch.cuda.empty_cache()
                try:
                    executor = engine_executor(model, host.for_placement(tiered), tiered, budget, max(tiers.sizes),
                                               args.ctx)
                except BudgetError as exc:
                    cell["skipped"][family] = str(exc)
                    continue
                seconds, cpu_s = step_and_cpu_seconds(executor, tier, args.ctx, args.seq_ctx)
                cell["measured_ms"][family] = seconds * 1e3
                cell.setdefault("host_compute_ms", {})[family] = cpu_s * 1e3
                cell.setdefault("peak_vram_gib", 0.0)
                cell["peak_vram_gib"] = max(cell["peak_vram_gib"], executor.peak_vram() / GiB)
                del executor
            measured = cell["measured_ms"]
            if tier_plan.family in measured:
                chosen = measured[tier_plan.family]
                cell["error_pct"] = (cell["predicted_ms"][tier_plan.family] - chosen) / chosen * 100
                cell["chosen_is_fastest"] = chosen <= min(measured.values()) * 1.02
                cell["distinct_plans_measured"] = len(measured)
            if tier == 1:
                cell.update(bound_tok_s=bound, additive_bound_tok_s=additive, shared_bound_tok_s=shared)
                if tier_plan.family in measured:
                    cell["tok_s"] = 1e3 / measured[tier_plan.family]
                    cell["of_bound"] = cell["tok_s"] / bound
                cell.update(layers_baseline(model, host, budget, args))
            if args.calibrate and tier_plan.family in measured:
                cell["calibrated"] = calibrated_cell(model, host, profile, plan, tier, budget, tiers, cell, args)
            cells.append(cell)
            log.info("%s", cell)
            if on_cell is not None:
                on_cell(entry)
    if entry["skipped"]:
        log.warning("%s: the deadline left out %s", name, ", ".join(entry["skipped"]))
    del host
    gc.collect()
    return entry


def calibrated_cell(model, host, profile, plan, tier: int, budget: int, tiers: Tiers, cell: dict, args) -> dict:
    """The engine's in-situ calibration, closed: fit the profile to the chosen plan's measured step
    as the engine does (the CPU factor from the executor's timing of the CPU work, then the
    dispatch from the rest: :func:`vramshard.plan.calibrate.fit_measured`; without a timing, the
    whole step's :func:`~vramshard.plan.calibrate.fit`), plan again with it, predict the new
    choice, then measure it (unless it is a placement already measured) and compare."""
    measured = cell["measured_ms"]
    chosen = plan.tiers[tier].family
    cpu_s = cell.get("host_compute_ms", {}).get(chosen, 0.0) / 1e3
    if cpu_s > 0:
        fitted = fit_measured(model, profile, plan, tier, measured[chosen] / 1e3, cpu_s)
    else:
        fitted = fit(model, profile, plan, measured[chosen] / 1e3, tier)
    if fitted is None:
        return {"fitted": None}
    again = Planner(model, fitted.profile, budget, context=args.ctx, tiers=tiers).plan()
    new = again.tiers[tier]
    out = {"fitted": fitted.what, "value": fitted.value, "family": new.family, "predicted_ms": new.predicted_s * 1e3}
    same = [f for f in measured if plan.tiers[tier].placements[f].where == new.placement.where
            and (plan.tiers[tier].threads if f == plan.tiers[tier].family else None) == new.threads]
    if same:
        out["same_as"], out["measured_ms"] = same[0], measured[same[0]]
    else:
        tiered = TieredPlacement((tier,), (new.placement,), (new.threads,), again.expert_cache)
        gc.collect()
        torch.cuda.empty_cache()
        try:
            executor = engine_executor(model, host.for_placement(tiered), tiered, budget, max(tiers.sizes), args.ctx)
        except BudgetError as exc:
            return {**out, "skipped": str(exc)}
        out["measured_ms"], out["host_compute_ms"] = (
            v * 1e3 for v in step_and_cpu_seconds(executor, tier, args.ctx, args.seq_ctx))
        del executor
    out["error_pct"] = (out["predicted_ms"] - out["measured_ms"]) / out["measured_ms"] * 100
    fastest = min([*measured.values(), out["measured_ms"]])
    out["is_fastest"] = out["measured_ms"] <= fastest * 1.02
    out["speedup_over_first_choice"] = measured[plan.tiers[tier].family] / out["measured_ms"]
    return out


def layers_baseline(model, host, budget: int, args) -> dict:
    largest = max(int(t) for t in args.tiers.split(","))
    n = max_resident_layers(model, budget, 1, args.ctx, largest)
    placement = named_placement(f"layers:{n}", sublayer_triples(model), model.args.num_hidden_layers)
    gc.collect()
    torch.cuda.empty_cache()
    # (the workspace N was chosen for: the largest tier's, not a fixed 512 tokens')
    executor = engine_executor(model, host.plain, placement, budget, largest, args.ctx)
    seconds = step_seconds(executor, 1, args.ctx, args.seq_ctx)
    del executor
    return {"baseline": placement.name, "baseline_tok_s": 1 / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="nemo-8b,llama3-8b")
    parser.add_argument("--budgets", default="2,4,8")
    parser.add_argument("--tiers", default="1,16,64,512")
    parser.add_argument("--ctx", type=int, default=4096, help="KV tokens reserved in all")
    parser.add_argument("--seq-ctx", type=int, default=1024, help="context of each decoding sequence, at most")
    parser.add_argument("--measure-within", type=float, default=3.0)
    parser.add_argument("--profile", default=None, help="profile file; default: a quick profile measured now")
    parser.add_argument("--calibrate", action="store_true",
                        help="per cell, also fit the profile to the chosen plan's step, re-plan, and measure the new choice")
    parser.add_argument("--deadline-s", type=float, default=480.0,
                        help="start no cell after this many seconds (those left out are named in the JSON)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from vramshard.profile import load, run_profile
    from vramshard.profile.spec import BenchmarkSpec

    t0 = time.perf_counter()
    profile = load(args.profile, check_fingerprint=False) if args.profile else run_profile(BenchmarkSpec.quick_spec())
    results = {"date": now(), "hardware": hardware(), "args": vars(args), "profile_s": time.perf_counter() - t0,
               "models": {}}
    shared = shared_read_bandwidth()
    bw = {"h2d": h2d_bandwidth(), "cpu_read": cpu_read_bandwidth(), "shared_cpu": shared["cpu"],
          "shared_h2d": shared["h2d"], "shared_total": shared["total"]}
    results["bandwidth_gb_s"] = {k: v / 1e9 for k, v in bw.items()}
    path = args.out or out_dir() / "planner_bench.json"
    deadline = t0 + args.deadline_s

    for name in args.models.split(","):
        def written(entry, name=name):  # each cell's results on disk as soon as it is done
            results["models"][name] = entry
            write_json(path, results)

        written(run_model(name, args, profile, bw, on_cell=written, deadline=deadline))
    results["elapsed_s"] = time.perf_counter() - t0
    write_json(path, results)


if __name__ == "__main__":
    main()
