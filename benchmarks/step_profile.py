"""Where one decode step spends its time: wall time against GPU kernel time, copy time, host
synchronisation and the number of launches, per placement, from torch.profiler.

    PYTHONPATH=src python -m benchmarks.step_profile --shape nemo-8b --placements gpu,gpu+graphs,static
    PYTHONPATH=src python -m benchmarks.step_profile --shape qwen3-30b-a3b --layers 8 \\
        --placements experts-stream,experts-cpu --expert-cache-gib 1 --json $OUT/moe_steps.json

Placements are the named ones (``gpu``, ``static``, ``stream``, ``layers:N``, ``experts-stream``,
``experts-cpu``, ...); ``NAME+graphs`` replays decode from CUDA graphs (``NAME+compiled``: with
their fusable parts compiled by inductor, as ``Engine.load(decode_compile=...)``);
``NAME+ahead`` hands split FFNs' CPU parts to the run-ahead worker (``VRAMSHARD_RUN_AHEAD``;
combine as ``planned:8+graphs+ahead``); ``NAME+packed`` computes CPU FFN parts from oneDNN-prepacked
weights (``VRAMSHARD_CPU_PACKED``); ``NAME+zerocopy`` has the GPU read host-memory experts itself
(``VRAMSHARD_EXPERTS_ZERO_COPY``, e.g. ``experts-cpu+zerocopy``; ``+zerocopy+share`` has the CPU
compute the share of them that the profile balances against the kernels, ``+share=0.4`` a given
share). ``planned:G`` is the planner's plan for the step's tier
(``--seqs`` rows, default 1) at a budget of G GiB on the ``--profile`` machine profile, scaled to the
host's memory read and CPU compute now as an engine scales it (its
predicted step time is printed beside the measured one; ``planned:G@T`` runs it with T CPU
threads; ``planned:G/FAMILY`` the placement it found for that family, e.g. ``planned:8/split``).
For each it prints one line of totals per decode step — wall ms, GPU kernel ms (memcpy excluded),
host-to-device copy ms, time the host spent blocked on the GPU, CUDA launches, aten ops; for ``planned:G``
also the bytes its split FFNs' CPU parts read and its fills move, and the rates they ran at — and the
top operators by host and by device time. If wall ≫ kernels + copies the step is bound by the host
(Python, dispatch, waiting); if kernels ≈ wall the kernels themselves are slow.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import functools
import logging
import pstats
import resource
import time

import torch
from torch.profiler import ProfilerActivity, profile

from vramshard.layers.step import Step
from vramshard.models import build_model
from vramshard.plan.calibrate import step_estimate
from vramshard.plan.estimator import balanced_zero_copy_share
from vramshard.plan.mechanisms import pricing_graphs
from vramshard.plan.memory import expert_slot_bytes, moe_layers, sublayer_triples
from vramshard.plan.placement import TieredPlacement, named_placement
from vramshard.plan.planner import Planner
from vramshard.plan.tiers import Tiers
from vramshard.profile import load
from vramshard.runtime import cpu_packed, run_ahead, zero_copy_experts
from vramshard.runtime.executor import Executor
from vramshard.runtime.host_weights import HostLayouts, pack_model
from vramshard.shapes import random_weights, shape_config

from .common import hardware, now, scaled_to_this_host, sync, write_json

log = logging.getLogger("step_profile")
GiB = 2**30
BLOCKING = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy ",
            "cudaMemcpy")  # host calls that wait for the GPU (cudaMemcpy without Async is synchronous)
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaGraphLaunch", "cuLaunchKernelEx")


def dispatch_us(device: str, n: int = 2000) -> float:
    """Microseconds per tiny in-place op: the floor of one launch (CUDA) or one aten call (CPU)."""
    x = torch.zeros(16, device=device)
    for _ in range(100):
        x.add_(1)
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        x.add_(1)
    sync()
    return (time.perf_counter() - t0) / n * 1e6


def step_split(prof, steps: int) -> dict:
    """Per-step totals from the profiler's events (times in ms)."""
    kernel_us = h2d_us = d2h_us = blocked_us = 0.0
    launches, aten = 0, 0
    for event in prof.events():
        name = event.name
        on_device = str(getattr(event, "device_type", "")).endswith("CUDA")
        if on_device:
            elapsed = event.time_range.elapsed_us()
            if name.startswith("Memcpy HtoD"):
                h2d_us += elapsed
            elif name.startswith("Memcpy DtoH"):
                d2h_us += elapsed
            elif not name.startswith(("Memcpy", "Memset")):
                kernel_us += elapsed
            continue
        if name.startswith(LAUNCHES):
            launches += 1
        elif name.startswith(BLOCKING) and not name.startswith("cudaMemcpyAsync"):
            blocked_us += event.cpu_time_total
        elif name.startswith("aten::"):
            aten += 1
    return {"gpu_kernel_ms": kernel_us / 1e3 / steps, "h2d_copy_ms": h2d_us / 1e3 / steps,
            "d2h_copy_ms": d2h_us / 1e3 / steps, "host_blocked_ms": blocked_us / 1e3 / steps,
            "launches": launches / steps, "aten_ops": aten / steps}


PLANNED_FROM: list[str] = []  # the profile each plan came from, and how it was scaled to this host (the JSON's)


@functools.cache
def planning_profile(path: str, dtype) -> object:
    """The profile at ``path`` scaled to this host's memory read and CPU compute now, as an engine plans
    with it (:func:`benchmarks.common.scaled_to_this_host`); once per process."""
    profile, source = scaled_to_this_host(load(path, check_fingerprint=False), path, dtype)
    log.info("planning from %s", source)
    PLANNED_FROM.append(source)
    return profile


def planned_executor(model, host: HostLayouts, spec: str, args, result: dict) -> Executor:
    """The planner's plan for the ``--seqs`` tier at ``planned:G`` GiB, under that budget
    (``planned:G@T``: run with T CPU threads instead of the plan's count; ``planned:G/FAMILY``: the
    placement the planner found for that family, e.g. ``split``, over the same pinned set, in place of
    the one it chose)."""
    gib, _, forced = spec.split(":", 1)[1].removesuffix("+graphs").partition("@")
    gib, _, family = gib.partition("/")
    budget = int(float(gib) * GiB)
    profile = planning_profile(args.profile, model.dtype)
    rows = args.seqs
    graphs = spec.endswith("+graphs")  # (the plan and its prediction price the graphs as the executor runs)
    with pricing_graphs(graphs):
        plan = Planner(model, profile, budget, context=rows * (args.ctx + 64), tiers=Tiers((rows,))).plan()
    tier = plan.tiers[rows]
    result["chosen_family"] = tier.family
    if family:
        if family not in tier.placements:
            raise ValueError(f"the planner found no {family!r} placement at {rows} row(s): it has "
                             f"{sorted(tier.placements)}")
        tier = dataclasses.replace(tier, family=family, placement=tier.placements[family],
                                   predicted_s=tier.candidates[family])
        plan = dataclasses.replace(plan, tiers={rows: tier})
    threads = int(forced) if forced else args.threads or tier.threads  # a sweep over the plan's count
    with pricing_graphs(graphs):
        estimate = step_estimate(model, profile, plan, rows)
    result.update(family=tier.family, predicted_ms=tier.predicted_s * 1e3, threads=threads,
                  predicted_cpu_busy_ms=estimate.cpu_busy * 1e3, predicted_copy_busy_ms=estimate.copy_busy * 1e3,
                  split_part_gb=split_part_bytes(model, tier.placement) / 1e9,
                  streamed_gb=estimate.bytes_streamed / 1e9)
    tiered = TieredPlacement((rows,), (tier.placement,), (threads,), plan.expert_cache)
    # (the workspace the plan counted, for its one tier: one of 64 rows took 12.01 GiB of a 12 GiB plan whose coded
    # pins filled it to the byte, fifty-third GPU session)
    return Executor(model, host.for_placement(tiered), tiered, budget=budget, max_tokens=rows,
                    max_context=rows * (args.ctx + 64), decode_graphs=graphs)


def split_part_bytes(model, placement) -> int:
    """Weight bytes a step's split dense FFNs' CPU parts read (gate, up and down rows; one row of x)."""
    return sum(model[name].part_bytes(0, placement[name].cpu_pieces) for name in placement.split_names())


def make_executor(model, host: HostLayouts, spec: str, args, result: dict) -> Executor:
    if spec.startswith("planned:"):
        return planned_executor(model, host, spec, args, result)
    name, graphs = spec.removesuffix("+compiled").removesuffix("+graphs"), spec.endswith(("+graphs", "+compiled"))
    layers = model.args.num_hidden_layers
    placement = named_placement(name, sublayer_triples(model), layers, moe_layers=moe_layers(model) or None)
    cache = None
    if name == "experts-stream":
        cache = max(int(args.expert_cache_gib * GiB), expert_slot_bytes(model))
    return Executor(model, host.for_placement(placement), placement, max_tokens=max(64, args.seqs),
                    max_context=args.seqs * (args.ctx + 64),
                    threads=args.threads, expert_cache=cache, decode_graphs=graphs,
                    decode_compile="inductor" if spec.endswith("+compiled") else None)


def profile_placement(model, host: HostLayouts, spec: str, args) -> dict:
    result = {"placement": spec}
    # NAME+ahead: split FFNs' CPU parts on the run-ahead worker (VRAMSHARD_RUN_AHEAD); NAME+packed:
    # CPU FFN parts from prepacked weights (VRAMSHARD_CPU_PACKED); NAME+zerocopy: host-memory experts
    # read by the GPU's kernels (VRAMSHARD_EXPERTS_ZERO_COPY).
    run_ahead.ENABLED = run_ahead.DENSE = "+ahead" in spec
    cpu_packed.MODE = "on" if "+packed" in spec else "off"
    zero_copy_experts.ENABLED = "+zerocopy" in spec
    spec, _, share = spec.partition("+share")  # NAME+zerocopy+share[=S]: the CPU's share beside the kernels
    for switch in ("+ahead", "+packed", "+zerocopy"):
        spec = spec.replace(switch, "")
    executor = make_executor(model, host, spec, args, result)
    if share or result["placement"].endswith("+share"):
        executor.zero_copy_cpu_share = float(share.removeprefix("=")) if share else \
            balanced_zero_copy_share(model, planning_profile(args.profile, model.dtype))
        result["zero_copy_cpu_share"] = executor.zero_copy_cpu_share
    rows = args.seqs
    kv = executor.new_kv_cache(rows, args.ctx + 64)
    token = torch.full((rows,), 3)
    position = args.ctx

    def decode_step():
        # ``rows`` sequences at the same position, one new token each (a decode tier of ``rows``).
        return Step(list(range(rows)), [position] * rows, [1] * rows, list(range(rows)), kv_lookup=kv)

    with torch.inference_mode():
        for _ in range(args.warmup):  # (CPU projections try their paths in their first 10-15 calls)
            executor.forward(token, decode_step())
            position += 1
        sync()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        host_compute = host_split = host_wait = 0.0
        for _ in range(args.steps):
            executor.forward(token, decode_step())
            host_compute += executor.report.host_compute_s
            host_split += executor.report.host_split_s
            host_wait += executor.report.host_wait_s
            position += 1
        sync()
        wall_ms = (time.perf_counter() - t0) / args.steps * 1e3
        # Minor page faults a step: fresh host memory touched for the first time (allocations).
        faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / args.steps
        result.update(rows=rows, host_compute_ms=host_compute / args.steps * 1e3,
                      host_split_ms=host_split / args.steps * 1e3, host_wait_ms=host_wait / args.steps * 1e3,
                      minor_faults=faults)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                executor.forward(token, decode_step())
                position += 1
            sync()
    result.update(wall_ms=wall_ms, peak_vram_gib=executor.peak_vram() / GiB, **step_split(prof, 3))
    if result.get("split_part_gb") and result["host_split_ms"]:  # the rates the step ran its parts and copies at
        result["split_part_gbps"] = result["split_part_gb"] / result["host_split_ms"] * 1e3
    if result.get("streamed_gb") and result["h2d_copy_ms"]:
        result["copy_gbps"] = result["streamed_gb"] / result["h2d_copy_ms"] * 1e3
    if executor.decode_compile:
        import torch._dynamo.utils as dynamo_utils

        from vramshard.runtime import graphs as graphs_module

        result["compile"] = {"unique_graphs": dynamo_utils.counters["stats"]["unique_graphs"],
                             "failed": [w.failed for w in graphs_module._compiled.values() if w.failed]}
    if executor.expert_cache is not None:
        result["expert_hit_rate"] = executor.expert_cache.stats.hit_rate
        result["expert_cache_slots"] = executor.expert_cache.capacity
    if args.trace:
        path = f"{args.trace}/trace_{spec.replace(':', '-').replace('+', '_')}.json"
        prof.export_chrome_trace(path)
        result["trace"] = path
    if args.pystats:
        with torch.inference_mode():
            result["python"] = python_stats(lambda: executor.forward(token, decode_step()), args.pystats)
    averages = prof.key_averages()
    result["top_host"] = top(averages, "self_cpu_time_total", args.rows)
    result["top_device"] = top(averages, "self_device_time_total", args.rows)
    del executor, kv
    torch.cuda.empty_cache()
    return result


def python_stats(step, rows: int, steps: int = 3) -> dict:
    """Where the host's time goes in ``steps`` calls of ``step`` by Python function (cProfile: it slows
    Python calls, so read the shares, not the totals): the ``rows`` functions with the most time of
    their own, and the ``rows`` with the most time including what they call, ms a step."""
    profiler = cProfile.Profile()
    sync()
    profiler.enable()
    for _ in range(steps):
        step()
    sync()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (calls, primitive calls, own s, total s, callers)}

    def rows_by(index: int) -> list[dict]:
        ranked = sorted(stats.items(), key=lambda item: item[1][index], reverse=True)[:rows]
        return [{"function": f"{file.rsplit('/', 2)[-1]}:{line}:{name}", "calls": calls / steps,
                 "own_ms": own / steps * 1e3, "total_ms": total / steps * 1e3}
                for (file, line, name), (_, calls, own, total, _) in ranked]

    total = sum(entry[2] for entry in stats.values())
    return {"total_ms": total / steps * 1e3, "by_own": rows_by(2), "by_total": rows_by(3)}


def top(averages, key: str, rows: int) -> list[dict]:
    """The ``rows`` operators with the most ``key`` (µs per 3 steps), with their call counts."""
    entries = [e for e in averages if getattr(e, key, 0)]
    entries.sort(key=lambda e: getattr(e, key), reverse=True)
    return [{"name": e.key[:80], "us": getattr(e, key), "calls": e.count} for e in entries[:rows]]


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="nemo-8b")
    parser.add_argument("--layers", type=int, default=None, help="cut the model to N layers (default: all)")
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10, help="timed decode steps per placement")
    parser.add_argument("--warmup", type=int, default=5, help="decode steps per placement before the timed ones")
    parser.add_argument("--seqs", type=int, default=1,
                        help="sequences decoding together (a decode tier of that many rows; planned:G plans it)")
    parser.add_argument("--placements", default="gpu,gpu+graphs,static")
    parser.add_argument("--expert-cache-gib", type=float, default=1.0, help="VRAM expert cache of experts-stream")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--profile", default="docs/profiles/h200-omp-active.json",
                        help="machine profile for planned:G placements")
    parser.add_argument("--rows", type=int, default=20)
    parser.add_argument("--trace", default=None, help="folder for chrome traces")
    parser.add_argument("--pystats", type=int, default=0, metavar="ROWS",
                        help="also run three steps under cProfile and keep the ROWS Python functions with the most "
                             "host time (their own, and with what they call)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("step_profile needs a CUDA GPU")
    config = shape_config(args.shape)
    if args.layers:
        config["num_hidden_layers"] = args.layers
    model = build_model(config)
    t0 = time.perf_counter()
    if any(s.kind == "ffn" and len(s.weights) > 8 for s in model):
        from .moe_bench import random_packed  # MoE shapes are large: weights made on the GPU

        host = HostLayouts(list(model), random_packed(model))
    else:  # the checkpoint's layout; the split-FFN layout is made if a planned placement splits
        host = HostLayouts(list(model), pack_model(list(model), random_weights(model), pin=True, splittable=False))
    log.info("%s (%d layers, %.1f GiB) built in %.1f s", args.shape, model.args.num_hidden_layers,
             model.nbytes / GiB, time.perf_counter() - t0)
    results = {"date": now(), "hardware": hardware(), "args": vars(args), "model_gib": model.nbytes / GiB,
               "dispatch_us": {"cuda": dispatch_us("cuda"), "cpu": dispatch_us("cpu")}, "placements": []}
    log.info("dispatch of one tiny op: %s", results["dispatch_us"])
    for spec in args.placements.split(","):
        try:
            result = profile_placement(model, host, spec, args)
        except Exception as exc:  # one placement's failure must not lose the others
            log.exception("%s failed", spec)
            results["placements"].append({"placement": spec, "error": f"{type(exc).__name__}: {exc}"})
            continue
        results["placements"].append(result)
        totals = {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()
                  if k not in ("top_host", "top_device")}
        log.info("%s", totals)
        for title, rows in (("host", result["top_host"]), ("device", result["top_device"])):
            log.info("  top by %s time (us over 3 steps, calls):\n%s", title,
                     "\n".join(f"    {r['us']:10.0f}  {r['calls']:6d}  {r['name']}" for r in rows))
        if "python" in result:
            for key in ("by_own", "by_total"):
                log.info("  Python functions %s (cProfile, %.1f ms a step in all; ms a step, calls a step):\n%s",
                         key.replace("_", " "), result["python"]["total_ms"],
                         "\n".join(f"    {r['own_ms']:8.2f} {r['total_ms']:8.2f} {r['calls']:8.1f}  {r['function']}"
                                   for r in result["python"][key]))
    if args.json:
        results["planned_from"] = PLANNED_FROM
        write_json(args.json, results)


if __name__ == "__main__":
    main()
