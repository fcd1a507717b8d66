"""A compiled CPU kernel on a worker thread beside a thread that runs Python: does either wait?

    PYTHONPATH=src python -m benchmarks.compiled_gil --json out.json
    VRAMSHARD_CPU_KERNELS_RELEASE_GIL=off PYTHONPATH=src python -m benchmarks.compiled_gil --json off.json

It times the compiled passes (``VRAMSHARD_CPU_GEMV=off``) and then, in the same run, what
``host_experts.routed`` runs by default since session 35: the C kernel's one call where it builds
(``layers/cpu_gemv.py``), whatever the mask; with the host's read time of the experts as the bound.

The run-ahead worker (``runtime/run_ahead.py``) computes CPU work while the host thread queues the
step's GPU work in Python. Inductor's compiled CPU kernels held the GIL while they ran, so the
worker was kept off them (``cpu_compiled.gil_kept_free``) and computed a MoE layer's routed experts
expert by expert instead. ``cpu_compiled.kernels_release_gil`` makes the kernels leave the GIL.

For one MoE layer's routed experts of one token (the compiled pass of ``layers/host_experts``, the
shape's experts over copies that exceed the last-level cache, as the executor reads them), with
the torch threads less one on the worker (the host thread keeps a core) and the run-ahead worker's
GIL switch interval: the pass alone on the main
thread, then on a worker while the main thread counts in a Python loop. It reports the pass's time
in both, and the Python thread's pace beside the pass over its pace alone (near 0: the pass kept it
waiting for the GIL). Run it with the switch on and off to compare.

Then how often a pass takes the GIL back (each take, beside a thread running Python, waits for the
switch interval): its time on the worker at a 50 ms interval, less its time alone, in intervals;
for the one-token pass (one compiled call, since session 25) and for the several-token pass the
one-token step took before (its glue is a dozen torch calls around the kernel).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import threading
import time

import torch

from vramshard.layers import cpu_compiled, cpu_gemv, host_experts
from vramshard.profile.bench_matmul import cold_bytes
from vramshard.runtime import run_ahead
from vramshard.shapes import shape_config

from .common import beside_python, cpu_read_bandwidth, hardware, now, write_json

log = logging.getLogger("compiled_gil")


def layer_copies(hidden: int, inter: int, experts: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copies of one layer's stacked experts (gate_up [E, 2F, D], down [E, D, F]) that together
    exceed twice the last-level cache; random, small."""
    one = experts * 3 * inter * hidden * dtype.itemsize
    count = max(2, -(-cold_bytes("cpu") // one))
    return [(torch.randn(experts, 2 * inter, hidden, dtype=dtype) * 0.02,
             torch.randn(experts, hidden, inter, dtype=dtype) * 0.02) for _ in range(count)]


COUNTING_INTERVAL_S = 0.05


def pass_seconds(h, layers, routing, repeats: int, keep=None) -> list[float]:
    """Seconds of each of ``repeats`` passes, cycling over the layer copies (``keep``: an all-True
    mask takes the several-token pass)."""
    experts, weights = routing
    times = []
    for i in range(repeats):
        gate_up, down = layers[i % len(layers)]
        start = time.perf_counter()
        out = host_experts.routed(h, gate_up, down, experts, weights, keep)
        times.append(time.perf_counter() - start)
        if out is None:
            raise RuntimeError("the compiled pass did not run here (no C++ compiler, or switched off)")
    return times


def gil_waits(h, layers, routing, keep, threads: int) -> float:
    """Switch intervals a pass waits for the GIL on a worker beside a thread running Python, at a
    50 ms interval: (its median time there less alone) / the interval."""
    alone = statistics.median(pass_seconds(h, layers, routing, 5, keep))
    beside = beside_python(lambda: pass_seconds(h, layers, routing, 3, keep), COUNTING_INTERVAL_S, threads)
    return max(0.0, statistics.median(beside) - alone) / COUNTING_INTERVAL_S


def python_pace(seconds: float) -> float:
    """Loop iterations per second of a bare Python counter on this thread for ``seconds``."""
    count, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        count += 1
    return count / seconds


def measure(h, layers, routing, top_k: int, threads: int, repeats: int) -> dict:
    """The pass alone, on a worker beside a Python thread, the several-token pass alone, and the GIL
    waits of both, as ``host_experts.routed`` runs them now."""
    pass_seconds(h, layers, routing, 2)  # compiles (where the compiled pass runs)
    alone = pass_seconds(h, layers, routing, repeats)
    pace_alone = python_pace(0.5)
    on_worker: list[float] = []
    done = threading.Event()

    def worker():
        with torch.inference_mode():
            torch.set_num_threads(threads)
            on_worker.extend(pass_seconds(h, layers, routing, repeats))
        done.set()

    thread = threading.Thread(target=worker, name="compiled-gil-worker")
    start = time.perf_counter()
    thread.start()
    counted = 0
    while not done.is_set():
        counted += 1
    wall = time.perf_counter() - start
    thread.join()
    every = torch.ones(1, top_k, dtype=torch.bool)
    pass_seconds(h, layers, routing, 2, every)  # compiles the several-token pass
    several_alone = pass_seconds(h, layers, routing, repeats, every)
    return {"pass_alone_ms": 1e3 * statistics.median(alone), "pass_on_worker_ms": 1e3 * statistics.median(on_worker),
            "python_pace_beside_over_alone": (counted / wall) / pace_alone,
            "several_token_pass_alone_ms": 1e3 * statistics.median(several_alone),
            "gil_waits_at_50ms": {"one_token_pass": gil_waits(h, layers, routing, None, threads),
                                  "several_token_pass": gil_waits(h, layers, routing, every, threads)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    config = shape_config(args.shape)
    dtype = getattr(torch, args.dtype)
    hidden, inter, count, top_k = (config["hidden_size"], config["moe_intermediate_size"], config["num_experts"],
                                   config["num_experts_per_tok"])
    releases = cpu_compiled.kernels_release_gil()
    sys.setswitchinterval(run_ahead.SWITCH_INTERVAL_S)  # as the run-ahead worker sets it
    threads = max(1, torch.get_num_threads() - 1)
    torch.set_num_threads(threads)
    bytes_read = top_k * 3 * inter * hidden * dtype.itemsize
    read = cpu_read_bandwidth()
    result = {
        "date": now(), "hardware": hardware(), "shape": args.shape, "dtype": args.dtype,
        "kernels_release_gil": releases, "worker_threads": threads, "switch_interval_s": sys.getswitchinterval(),
        "cpu_read_gb_s": read / 1e9, "pass_bound_ms": 1e3 * bytes_read / read, "cpu_gemv": cpu_gemv.isa(),
        "kernels": {},
    }
    before = os.environ.get("VRAMSHARD_CPU_GEMV")
    with torch.inference_mode():
        layers = layer_copies(hidden, inter, count, dtype)
        h = torch.randn(1, hidden, dtype=dtype)
        routing = (torch.randperm(count)[:top_k][None], torch.full((1, top_k), 1.0 / top_k, dtype=dtype))
        try:
            for label, mode in (("compiled", "off"), ("C kernel", "auto")):
                os.environ["VRAMSHARD_CPU_GEMV"] = mode  # (host_experts reads it at each call)
                cell = result["kernels"][label] = measure(h, layers, routing, top_k, threads, args.repeats)
                cell["pass_gb_s_alone"] = bytes_read / (cell["pass_alone_ms"] / 1e3) / 1e9
                log.info("%s (compiled kernels release the GIL: %s): pass alone %.2f ms (bound %.2f), on the worker "
                         "beside a Python thread %.2f ms; the Python thread ran at %.2f of its pace alone; the "
                         "several-token pass alone %.2f ms; GIL waits a pass beside Python: one-token %.1f, "
                         "several-token %.1f", label, releases, cell["pass_alone_ms"], result["pass_bound_ms"],
                         cell["pass_on_worker_ms"], cell["python_pace_beside_over_alone"],
                         cell["several_token_pass_alone_ms"], cell["gil_waits_at_50ms"]["one_token_pass"],
                         cell["gil_waits_at_50ms"]["several_token_pass"])
        finally:
            if before is None:
                os.environ.pop("VRAMSHARD_CPU_GEMV", None)
            else:
                os.environ["VRAMSHARD_CPU_GEMV"] = before
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
