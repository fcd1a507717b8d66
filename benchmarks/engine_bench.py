"""Engine benchmark for the GPU machine, in one call: the grid of the Engine issue, JSON to $OUT.

    PYTHONPATH=src python -m benchmarks.engine_bench             # about 6-8 minutes on the H200 box (< 9)
    PYTHONPATH=src python -m benchmarks.engine_bench --quick     # smoke test: 2 layers, tiny token counts

For each model (nemo-8b fp16, llama3-8b bf16; random weights of the real shapes, built once on
the GPU and packed into pinned host memory, shared by every engine of the model):
  - ``unconstrained``: the whole model resident in VRAM, no budget (the GPU reference: decode
    tok/s against the GPU memory-bandwidth bound: the bytes a decode step reads, weights but the
    gathered embedding table plus the KV cache at the tg context, / measured device bandwidth);
  - for each budget (2 and 8 GiB): the planned engine (``vramshard``) and the best ``layers:N``
    baseline (``layers:max``: as many whole layers as fit, the rest on the CPU; what ``-ngl N`` does).
Each engine: TTFT of a 1K prompt (pp tok/s), decode tok/s at 1K context (tg: 32 tokens after
it), batched throughput at batch 1/4/16/64 (16-token prompts, 16 new tokens each), the Python scheduling time per step (outside executor.forward),
peak VRAM against the budget. Derived checks: batch-64 throughput of vramshard / baseline at
8 GiB, and TTFT at 2 GiB / ((weights bytes - resident bytes) / h2d bandwidth + unconstrained TTFT);
the largest batch's step bound (B tokens over (bytes outside VRAM) / (h2d + the profile's CPU weight
rate at B rows)) and that bound over the baseline's measured batch, the most the engine could lead by
at decode steps; the run's bound (its prompt step as measured, each decode step after it at the step bound)
over the baseline's batch; and the batch's decode steps alone against the baseline's.

The planner uses the stored machine profile when there is one, else a synthetic profile fitted
to bandwidths and a matmul speed measured here in seconds (``--profile PATH`` to give one).
Every run stops stepping after ``--run-limit-s``; cells are skipped once ``--deadline-s`` is
spent, and the JSON is rewritten after every cell, so a cut-short run still reports.

Each cell records the host's memory read just before and after it (``host_read_gb_s``): on shared hosts it
moved 1.6x within minutes (session 48); and the cores other processes kept busy over it, with the steal among
them (``host_beside_cores``, Linux). The checks give the planned cell's read over its baseline's
(``*_host_read_vramshard_over_layers_max``: a lead is the engine's only where that is near 1) and decode's
bound at the read around the planned cell (``*_decode_fraction_of_bound_at_cell_read``).
With ``--abba`` each budget's planned engine and baseline run twice, planned-baseline-baseline-planned, and
the checks are the two rounds' geometric means (each round's under ``rounds``). The second planned engine
starts from the factors the first fitted (as a user's second run does, from the calibration store).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import statistics
import time

import torch

from vramshard.cli.bench import BenchSettings, EngineSpec, bench_engine
from vramshard.layers.mlp import DenseFFN
from vramshard.runtime import plan_process
from vramshard.runtime.host_load import OtherLoad
from vramshard.runtime.host_weights import HostLayouts, pack_model
from vramshard.runtime.wire_codec import wire_ratio
from vramshard.shapes import random_weights, shape_model

from .common import (coded_link, cpu_read_bandwidth, decode_bound_tok_s, decode_read_bytes, h2d_bandwidth, hardware,
                     now, out_dir, scaled_to_this_host, shared_read_bandwidth, sync, write_json)

log = logging.getLogger("engine_bench")
GiB = 2**30
MODELS = {"nemo-8b": torch.float16, "llama3-8b": torch.bfloat16}
_DTYPE_KEYS = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def device_bandwidth(nbytes: int = 2**31) -> float:
    """Bytes/s the GPU moves device to device (read + write of one large copy)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync()
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    sync()
    seconds = (time.perf_counter() - t0) / 5
    del src, dst
    return 2 * nbytes / seconds


def cpu_matmul_gflops(dtype: torch.dtype, m: int = 256, k: int = 4096, n: int = 4096) -> float:
    a = torch.randn(m, k).to(dtype)
    b = torch.randn(k, n).to(dtype)
    a @ b
    t0 = time.perf_counter()
    for _ in range(3):
        a @ b
    return 2 * m * k * n * 3 / (time.perf_counter() - t0) / 1e9


def gpu_matmul_gflops(dtype: torch.dtype, size: int = 8192) -> float:
    a = torch.randn(size, size, device="cuda", dtype=dtype)
    b = torch.randn(size, size, device="cuda", dtype=dtype)
    a @ b
    sync()
    t0 = time.perf_counter()
    for _ in range(5):
        a @ b
    sync()
    return 2 * size**3 * 5 / (time.perf_counter() - t0) / 1e9


def planner_profile(path: str | None, bandwidth: dict, dtypes) -> tuple[object, str]:
    """(profile, where it came from): --profile, the stored one, or a synthetic one fitted here. A
    measured profile of this machine is scaled to the host's memory read now, as an engine scales
    it when it loads (:mod:`vramshard.profile.drift`); the source says by how much."""
    from vramshard.profile import drift, load, load_or_none, synthetic

    measured = load(path, check_fingerprint=False) if path else load_or_none()
    if measured is not None:
        source = path or "stored"
        if not measured.data.get("synthetic") and not drift.is_this_machines(measured):  # (priced by another host)
            source += " (another machine's: its fingerprint differs from this one's)"
            log.warning("the profile %s was measured on another machine; the planned engines price this one by it",
                        source)
        return scaled_to_this_host(measured, source)
    cpu = {key: 0.0 for key in ("bf16", "fp16", "fp32")}
    gpu = dict(cpu)
    for dtype in (torch.float32, *dtypes):
        cpu[_DTYPE_KEYS[dtype]] = cpu_matmul_gflops(dtype)
        gpu[_DTYPE_KEYS[dtype]] = gpu_matmul_gflops(dtype)
    for key in cpu:  # dtypes not measured: the fp32 speed
        cpu[key] = cpu[key] or cpu["fp32"]
        gpu[key] = gpu[key] or gpu["fp32"]
    log.info("synthetic profile: cpu GFLOP/s %s, gpu GFLOP/s %s", cpu, gpu)
    profile = synthetic(cpu_gflops=cpu, gpu_gflops=gpu, h2d_gbps=bandwidth["h2d"], cpu_mem_gbps=bandwidth["cpu_read"],
                        gpu_mem_gbps=bandwidth["device"], cpu_threads=torch.get_num_threads())
    return profile, "synthetic (fitted)"


def cpu_rows_gb_s(profile, model, rows: int) -> float | None:
    """Weight GB/s the CPU's matmuls get through at ``rows`` rows by ``profile`` (the model's FFN gate/up
    shape, all threads; None where the profile or the model has none)."""
    ffn = next((s for s in model if isinstance(s, DenseFFN)), None)
    if profile is None or ffn is None:
        return None
    seconds = profile.matmul_s(rows, ffn.hidden, ffn.intermediate, model.dtype, "cpu")
    return ffn.hidden * ffn.intermediate * model.dtype.itemsize / seconds / 1e9 if seconds > 0 else None


def derived(cells: list[dict], weights: int, decode_bytes: int, bandwidth: dict,
            cpu_rows: dict[int, float] | None = None) -> dict:
    """The issue's checks from the cells of one model; ``decode_bytes``: what a decode step reads;
    ``cpu_rows``: weight GB/s of the CPU's matmuls by rows (:func:`cpu_rows_gb_s`), for the batched bound."""
    by = {(c["engine"], c.get("vram")): c for c in cells if "error" not in c}
    out = {}
    free = by.get(("unconstrained", None))
    if free and free.get("tg_tok_s"):
        bound = bandwidth["device"] * 1e9 / decode_bytes
        out["unconstrained_decode_fraction_of_bandwidth_bound"] = free["tg_tok_s"] / bound
        out["decode_bandwidth_bound_tok_s"] = bound
        eager = by.get(("unconstrained+eager", None))
        if eager and eager.get("tg_tok_s"):
            out["unconstrained_eager_decode_fraction_of_bandwidth_bound"] = eager["tg_tok_s"] / bound
    for budget in {c.get("vram") for c in cells if c.get("vram") is not None}:
        ours, base = by.get(("vramshard", budget)), by.get(("layers:max", budget))
        key = f"{budget / GiB:g}GiB"
        if ours and base:
            b64 = [str(s) for s in ours["batched"] if s in base["batched"]]
            if b64:
                top = max(b64, key=int)
                out[f"{key}_batch{top}_speedup_vs_layers_max"] = (
                    ours["batched"][top]["tok_s"] / base["batched"][top]["tok_s"])
                rate = (cpu_rows or {}).get(int(top))
                if rate and weights > resident_weights(ours):
                    # The most a step of `top` sequences' next tokens can do: every byte outside VRAM
                    # crosses PCIe or is computed by the CPU at the profile's rate for that many rows,
                    # both at once and alone-fast, GPU compute free (an optimistic bound), and no faster
                    # than host memory gives both readers together (the CPU's matmuls read their weights).
                    rate_total = bandwidth["h2d"] + rate
                    out[f"{key}_batch{top}_step_additive_bound_tok_s"] = (
                        int(top) * rate_total * 1e9 / (weights - resident_weights(ours)))
                    rate_total = min(rate_total, bandwidth.get("shared_total", rate_total))
                    bound = int(top) * rate_total * 1e9 / (weights - resident_weights(ours))
                    out[f"{key}_batch{top}_step_bound_tok_s"] = bound
                    out[f"{key}_batch{top}_step_bound_over_layers_max"] = bound / base["batched"][top]["tok_s"]
                    # The whole run's bound: its prompt step as measured, every decode step after it at the bound.
                    run = ours["batched"][top]
                    if run.get("prefill_s") is not None and run.get("generated"):
                        decode_steps = run["generated"] / int(top) - 1
                        run_bound = run["generated"] / (run["prefill_s"] + decode_steps * int(top) / bound)
                        out[f"{key}_batch{top}_run_bound_over_layers_max"] = run_bound / base["batched"][top]["tok_s"]
                if ours["batched"][top].get("decode_tok_s") and base["batched"][top].get("decode_tok_s"):
                    out[f"{key}_batch{top}_decode_speedup_vs_layers_max"] = (
                        ours["batched"][top]["decode_tok_s"] / base["batched"][top]["decode_tok_s"])
            out[f"{key}_ttft_speedup_vs_layers_max"] = base["ttft_s"] / ours["ttft_s"]
            out[f"{key}_tg_speedup_vs_layers_max"] = (ours["tg_tok_s"] or 0) / (base["tg_tok_s"] or float("inf"))
            if ours.get("host_read_gb_s") and base.get("host_read_gb_s"):
                # Over 1 the planned cell ran on a faster-reading host than its baseline: its lead is partly the host's.
                out[f"{key}_host_read_vramshard_over_layers_max"] = (
                    statistics.mean(ours["host_read_gb_s"]) / statistics.mean(base["host_read_gb_s"]))
        if ours and free:
            bound = (weights - resident_weights(ours)) / (bandwidth["h2d"] * 1e9) + free["ttft_s"]
            out[f"{key}_ttft_bound_s"] = bound
            out[f"{key}_ttft_over_bound"] = ours["ttft_s"] / bound
        if ours and ours.get("tg_tok_s") and weights > resident_weights(ours):
            # Decode's bound at the budget: every byte not resident crosses PCIe or is read by the CPU,
            # both at once at best, and no faster than host memory gives both readers together (the
            # smaller figure, as planner_bench and the report take it; the sum of the rates alone kept).
            outside = weights - resident_weights(ours)
            bound, additive = decode_bound_tok_s(outside, bandwidth)
            out[f"{key}_decode_additive_bound_tok_s"] = additive
            out[f"{key}_decode_bound_tok_s"] = bound
            out[f"{key}_decode_fraction_of_bound"] = ours["tg_tok_s"] / bound
            if ours.get("host_read_gb_s"):
                # The same bound at the host's read around the cell, not the run's start.
                at_cell, _ = decode_bound_tok_s(outside, bandwidth, statistics.mean(ours["host_read_gb_s"]))
                out[f"{key}_decode_bound_at_cell_read_tok_s"] = at_cell
                out[f"{key}_decode_fraction_of_bound_at_cell_read"] = ours["tg_tok_s"] / at_cell
    return out



def derived_rounds(cells: list[dict], weights: int, decode_bytes: int, bandwidth: dict,
                   cpu_rows: dict[int, float] | None = None) -> dict:
    """:func:`derived` of cells measured in rounds (``--abba``: each cell's ``round``; cells without one, the
    unconstrained engine's, belong to every round): each check the geometric mean of the rounds' that have it
    (planned, baseline, baseline, planned: a drift of the host's speed that is steady over the four cells
    scales both engines' products alike), each round's own checks under ``rounds``. Without rounds, :func:`derived`."""
    rounds = sorted({c["round"] for c in cells if c.get("round") is not None})
    if not rounds:
        return derived(cells, weights, decode_bytes, bandwidth, cpu_rows)
    shared = [c for c in cells if c.get("round") is None]
    per = [derived(shared + [c for c in cells if c.get("round") == r], weights, decode_bytes, bandwidth, cpu_rows)
           for r in rounds]
    out: dict = {}
    for key in dict.fromkeys(k for checks in per for k in checks):
        values = [checks[key] for checks in per if key in checks]
        out[key] = statistics.geometric_mean(values) if all(v > 0 for v in values) else statistics.mean(values)
    out["rounds"] = per
    return out


@contextlib.contextmanager
def _gemv_off(off: bool):
    """Within: the C decode kernel off (layers/cpu_gemv.py reads VRAMSHARD_CPU_GEMV at each call)."""
    if not off:
        yield
        return
    before = os.environ.get("VRAMSHARD_CPU_GEMV")
    os.environ["VRAMSHARD_CPU_GEMV"] = "off"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("VRAMSHARD_CPU_GEMV", None)
        else:
            os.environ["VRAMSHARD_CPU_GEMV"] = before

def resident_weights(row: dict) -> int:
    """Bytes of weights a cell kept in VRAM (coded pins hold more weights than their bytes; older rows: the bytes)."""
    return row.get("resident_weight_bytes", row["resident_bytes"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--budgets", default="8,2", help="GiB, comma-separated (first ones run first)")
    parser.add_argument("--pp", type=int, default=1024)
    parser.add_argument("--tg", type=int, default=32, help="decode tokens after the pp prompt (tok/s at ~pp context)")
    parser.add_argument("--batch-sizes", default="1,4,16,64")
    parser.add_argument("--batch-prompt", type=int, default=16)
    parser.add_argument("--batch-gen", type=int, default=16)
    parser.add_argument("--run-limit-s", type=float, default=10.0, help="most seconds of one measured run")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs of each test (TTFT/tg and each batch size); the median is kept")
    parser.add_argument("--deadline-s", type=float, default=400.0, help="start no new cell after this")
    parser.add_argument("--baseline", default="layers:max")
    parser.add_argument("--abba", action="store_true",
                        help="run each budget's planned engine and baseline twice, in the order planned, baseline, "
                             "baseline, planned (cells of rounds 1 and 2); the checks are the rounds' geometric "
                             "means, so a host whose speed drifts steadily moves both engines alike")
    parser.add_argument("--without-gemv", action="store_true",
                        help="also run the planned engine of each budget with the C decode kernel off "
                             "(label vramshard+no-gemv; VRAMSHARD_CPU_GEMV=off for that cell)")
    parser.add_argument("--profile", default=None, help="machine profile for the planner")
    parser.add_argument("--layers", type=int, default=None, help="cut every model to N layers")
    parser.add_argument("--quick", action="store_true", help="smoke test: 2 layers, small token counts")
    parser.add_argument("--eager", action="store_true",
                        help="also run every engine without CUDA graphs (label +eager; the default replays "
                             "decode steps over resident sub-layers from graphs)")
    parser.add_argument("--compile", action="store_true",
                        help="also run the unconstrained engine with its CUDA-graph decode steps' segments "
                             "compiled by inductor (label unconstrained+compiled)")
    parser.add_argument("--overlap-off", action="store_true",
                        help="also run the unconstrained engine reading every step before the next "
                             "(label +no-overlap)")
    parser.add_argument("--log-steps", action="store_true",
                        help="log every step's times and each row-major down copy made (DEBUG)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.log_steps:
        for name in ("vramshard.runtime.scheduler", "vramshard.runtime.cpu_down"):
            logging.getLogger(name).setLevel(logging.DEBUG)
    if args.quick:
        args.layers, args.pp, args.tg, args.batch_prompt, args.batch_gen = 2, 64, 8, 8, 4
    t_start = time.perf_counter()
    target = args.out or out_dir() / "engine_bench.json"
    settings = BenchSettings(args.pp, args.tg, tuple(int(b) for b in args.batch_sizes.split(",")), args.batch_prompt,
                             args.batch_gen, repeat=args.repeat, time_limit_s=args.run_limit_s)
    if not torch.cuda.is_available():
        raise SystemExit("engine_bench needs a CUDA GPU (use `vramshard bench --shape tiny-llama` on a CPU)")
    shared = shared_read_bandwidth()  # host memory to the CPU and the copy engine reading at once
    bandwidth = {"h2d": h2d_bandwidth() / 1e9, "cpu_read": cpu_read_bandwidth() / 1e9,
                 "device": device_bandwidth() / 1e9, "shared_cpu": shared["cpu"] / 1e9,
                 "shared_h2d": shared["h2d"] / 1e9, "shared_total": shared["total"] / 1e9}
    log.info("bandwidth GB/s: %s", bandwidth)
    names = args.models.split(",")
    profile, profile_source = planner_profile(args.profile, bandwidth, {MODELS.get(n, torch.bfloat16) for n in names})
    results = {"date": now(), "hardware": hardware(), "args": vars(args), "bandwidth_gb_s": bandwidth,
               "profile": profile_source, "settings": vars(settings), "models": {}, "skipped": []}
    for name in names:
        model = shape_model(name, MODELS.get(name))
        if args.layers:
            from vramshard.models import build_model
            from vramshard.shapes import shape_config

            config = shape_config(name)
            config["num_hidden_layers"] = args.layers
            model = build_model(config, MODELS.get(name))
        t0 = time.perf_counter()
        # The planned engines get the split-FFN layout (made on first need), baselines the checkpoint's.
        host = HostLayouts(list(model), pack_model(list(model), random_weights(model), pin=True, splittable=False))
        log.info("%s: %.1f GiB built and pinned in %.1f s", name, model.nbytes / GiB, time.perf_counter() - t0)
        eager, compiled = {"decode_graphs": False}, {"decode_compile": "inductor"}
        free = [EngineSpec("unconstrained", "gpu", None)]
        free += [EngineSpec("unconstrained+no-overlap", "gpu", None, {"overlap": False})] if args.overlap_off else []
        free += [EngineSpec("unconstrained+compiled", "gpu", None, compiled)] if args.compile else []
        free += [EngineSpec("unconstrained+eager", "gpu", None, eager)] if args.eager else []
        specs = [(spec, None) for spec in free]  # (spec, its round under --abba; None: every round's)
        for budget in [b for b in args.budgets.split(",") if b]:
            vram = int(float(budget) * GiB)
            ours = [EngineSpec("vramshard", None, vram)]
            ours += [EngineSpec("vramshard+eager", None, vram, eager)] if args.eager else []
            ours += [EngineSpec("vramshard+no-gemv", None, vram)] if args.without_gemv else []
            theirs = [EngineSpec(args.baseline, args.baseline, vram)]
            if args.abba:
                specs += [(spec, 1) for spec in ours + theirs] + [(spec, 2) for spec in theirs + ours]
            else:
                specs += [(spec, None) for spec in ours + theirs]
        cpu_rows = {b: cpu_rows_gb_s(profile, model, b) for b in settings.batch_sizes}
        cells: list[dict] = []
        entry = results["models"][name] = {"bytes": model.nbytes, "dtype": str(model.dtype), "cells": cells}
        for spec, round_ in specs:
            if time.perf_counter() - t_start > args.deadline_s:
                results["skipped"].append(f"{name} {spec.label} {spec.vram}")
                log.warning("deadline: skipping %s %s %s", name, spec.label, spec.vram)
                continue
            read_before = cpu_read_bandwidth() / 1e9
            beside = OtherLoad(children=plan_process.child_pids)  # (the engine's planning process is its own)
            beside.cores()  # (starts the count)
            t0 = time.perf_counter()
            with _gemv_off(spec.label.endswith("+no-gemv")):
                cell = bench_engine(model, host, spec, settings, device="cuda", profile=profile)
            cell["cell_s"] = time.perf_counter() - t0
            # The host's read just before and after the cell: shared hosts moved 1.6x within minutes (session 48),
            # so a planned cell and its baseline compare only where their reads are near (see `derived`).
            cell["host_read_gb_s"] = [read_before, cpu_read_bandwidth() / 1e9]
            # The cores other processes kept busy over the cell, and the steal among them (a virtual machine's host
            # running its other guests: the fifty-fifth session's host timed one product 2.4x apart minutes apart).
            others = beside.cores()
            if others is not None:
                cell["host_beside_cores"] = {"others": round(others, 3), "steal": round(beside.steal, 3)}
            if round_ is not None:
                cell["round"] = round_
            cells.append(cell)
            log.info("%s %s %s: %s", name, spec.label, spec.vram,
                     cell.get("error") or {k: cell.get(k) for k in ("placement", "ttft_s", "tg_tok_s", "peak_vram_bytes", "load_seconds")})
            # The bounds count the link's bytes as the planned engine's fills move them (coded: runtime/wire_codec).
            entry["wire_ratio"] = wire_ratio(model.dtype)
            entry["checks"] = derived_rounds(cells, model.nbytes, decode_read_bytes(model, args.pp + args.tg // 2),
                                             coded_link(bandwidth, entry["wire_ratio"]), cpu_rows)
            results["elapsed_s"] = time.perf_counter() - t_start
            write_json(target, results)
        del host
        gc.collect()
        torch.cuda.empty_cache()
    results["elapsed_s"] = time.perf_counter() - t_start
    write_json(target, results)
    log.info("done in %.0f s: %s", results["elapsed_s"], target)


if __name__ == "__main__":
    main()
