"""The run-ahead worker's host-expert parts as one bound C call against the Python job around the same kernel.

    PYTHONPATH=src python -m benchmarks.worker_one_call [--parts 48] [--steps 8] [--gap-us 150] [--idle-host]
                                                        [--json FILE]

A decode step of qwen3-30b-a3b with its experts on the CPU is a chain of 48 parts: the GPU's part of a layer
(attention, router, the copies), then the worker's routed experts, whose ticket lets the GPU go on. Here a
second process stands in for the GPU (it needs no GIL, as the GPU does not, and sleeps between its reads, as
the GPU takes no core): for each part it waits for the last part's ticket, sleeps ``--gap-us`` (the GPU's part
of a layer: 0.15-0.17 ms in the thirty-fourth and forty-first GPU sessions), then writes the ready word. This
process's worker (:class:`vramshard.runtime.run_ahead.RunAhead`) computes each part, 8 experts of a
Qwen3-30B-A3B layer's shape drawn at random from ``--experts`` per layer, while its host thread runs Python all
the time (as the host thread queuing a step does; the switch interval as a worker sets it; ``--idle-host``: it
sleeps). Both ways run in turn, ``--rounds`` times: ``one call`` (``VRAMSHARD_RUN_AHEAD_ONE_CALL`` on: wait,
kernel and ticket in one C call, the GIL free) and ``python job`` (off: the C wait, then Python around the
kernel's call, the copy into the result buffer and the ticket). The bound: each part's gap plus its kernel
alone (the same routing, timed on this thread before); the stand-in GPU's sleeps overshoot their time (tens of
microseconds), both ways alike.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import statistics
import time
from multiprocessing import shared_memory

import numpy as np
import torch

from vramshard.layers import cpu_gemv
from vramshard.layers.moe import DictExperts, MoEFFN, Routing
from vramshard.runtime import run_ahead

from .common import hardware, now, rounded, write_json

log = logging.getLogger("worker_one_call")

HIDDEN, WIDTH, TOP_K = 2048, 768, 8  # Qwen3-30B-A3B's experts
POLL_S = 20e-6  # the stand-in GPU's sleep between reads of the ticket (it must not take a core the worker needs)


def _gpu(words_name: str, parts: int, steps: int, gap_s: float) -> None:
    """The GPU's side: for each part, the last part's ticket, a pause, then the ready word (words: ready,
    ticket, and a start flag the main process raises for each step)."""
    memory = shared_memory.SharedMemory(name=words_name)
    words = np.ndarray((3,), np.int64, memory.buf)
    number = 0
    for step in range(1, steps + 1):
        while words[2] < step:  # the main process has queued the step
            time.sleep(POLL_S)
        for _ in range(parts):
            while words[1] < number:
                time.sleep(POLL_S)
            time.sleep(gap_s)
            number += 1
            words[0] = number
    del words
    memory.close()


class _Queued:
    """A GPU kernel's launch as the host thread sees it here: queued, nothing done (the other process is the GPU)."""

    def __getitem__(self, grid):
        return lambda *args: None


def _layers(count: int, experts: int, generator: torch.Generator) -> list[DictExperts]:
    out = []
    for _ in range(count):
        stacked = (torch.randn(experts, 3 * WIDTH * HIDDEN, generator=generator) * 0.02).to(torch.bfloat16)
        weights = {}
        for e in range(experts):
            weights[f"experts.{e}.gate_up"] = stacked[e, : 2 * WIDTH * HIDDEN].view(2 * WIDTH, HIDDEN)
            weights[f"experts.{e}.down"] = stacked[e, 2 * WIDTH * HIDDEN:].view(HIDDEN, WIDTH)
        out.append(DictExperts(weights, experts, stack=True))
    return out


def run(parts: int, steps: int, gap_s: float, rounds: int, experts: int, layers: int, threads: int,
        busy_host: bool = True) -> dict:
    generator = torch.Generator().manual_seed(0)
    sources = _layers(layers, experts, generator)
    layer = MoEFFN.__new__(MoEFFN)  # (run_experts and experts_part read nothing of the layer's config)
    h = torch.randn(1, HIDDEN, generator=generator).to(torch.bfloat16)
    routings = [Routing(torch.randperm(experts, generator=generator)[:TOP_K].view(1, TOP_K),
                        torch.rand(1, TOP_K, generator=generator).to(torch.bfloat16)) for _ in range(parts)]
    torch.set_num_threads(threads)
    alone = []
    for i, routing in enumerate(routings * 2):  # (the first pass warms up)
        began = time.perf_counter()
        layer.run_experts(sources[i % layers], h, routing)
        alone.append(time.perf_counter() - began)
    kernel_alone_s = sum(alone[parts:])

    run_ahead._write_word, run_ahead._wait_for_ticket = _Queued(), _Queued()
    run_ahead.WAIT = "kernel"
    ahead = run_ahead.RunAhead()
    ahead.team = threads
    memory = shared_memory.SharedMemory(create=True, size=24)
    words = np.ndarray((3,), np.int64, memory.buf)
    words[:] = 0
    ahead.ready, ahead.ticket = torch.from_numpy(words[0:1]), torch.from_numpy(words[1:2])
    ahead._ready_view, ahead._ticket_view = words[0:1], words[1:2]
    modes = ["one call", "python job"] * rounds
    gpu = multiprocessing.get_context("fork").Process(target=_gpu, args=(memory.name, parts, steps * len(modes), gap_s))
    gpu.start()
    results: dict[str, list[float]] = {mode: [] for mode in modes}
    step = 0
    try:
        for mode in modes:
            run_ahead.ONE_CALL = mode == "one call"
            for _ in range(steps):
                step += 1
                for i, routing in enumerate(routings):
                    number = ahead.copied()
                    source = sources[i % layers]
                    ahead.result_on(torch.device("cpu"), number, h,
                                    lambda out, s=source, r=routing: out.copy_(layer.run_experts(s, h, r)),
                                    lambda out, s=source, r=routing: layer.experts_part(s, h, r, out))
                began = time.perf_counter()
                words[2] = step  # the GPU starts the step
                while words[1] < number:  # the host thread's Python while the step runs
                    sum(range(200)) if busy_host else time.sleep(1e-3)
                results[mode].append(time.perf_counter() - began)
                ahead.drain()
    finally:
        gpu.join(timeout=30)
        ahead.close()
        del words
        memory.close()
        memory.unlink()
    bound_s = parts * gap_s + kernel_alone_s
    cells = []
    for mode, times in results.items():
        median = statistics.median(times)
        cells.append({"mode": mode, "step_ms_median": median * 1e3, "step_ms_all": [t * 1e3 for t in times],
                      "per_part_beyond_bound_us": (median - bound_s) / parts * 1e6, "of_bound": bound_s / median})
    return {"parts": parts, "gap_us": gap_s * 1e6, "threads": threads, "busy_host": busy_host,
            "experts_per_layer": experts,
            "kernel_alone_ms": kernel_alone_s * 1e3, "bound_ms": bound_s * 1e3, "cells": cells}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", type=int, default=48)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--gap-us", type=float, default=150.0)
    parser.add_argument("--experts", type=int, default=16, help="experts per layer to draw from")
    parser.add_argument("--layers", type=int, default=8, help="distinct layers the parts walk through")
    parser.add_argument("--threads", type=int, default=None, help="the worker's team (default: the worker's own)")
    parser.add_argument("--idle-host", action="store_true", help="the host thread sleeps through the steps")
    parser.add_argument("--json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if cpu_gemv.library() is None:
        raise SystemExit(f"the C kernel does not build here: {cpu_gemv.failure()}")
    threads = args.threads or run_ahead.largest_team(torch.get_num_threads())
    result = {"when": now(), "hardware": hardware(),
              **run(args.parts, args.steps, args.gap_us * 1e-6, args.rounds, args.experts, args.layers, threads,
                    not args.idle_host)}
    log.info("%d parts, gap %.0f us, team %d: kernel alone %.1f ms, bound %.1f ms", result["parts"],
             result["gap_us"], threads, result["kernel_alone_ms"], result["bound_ms"])
    for cell in result["cells"]:
        log.info("  %-10s step %.1f ms (median of %d), %.0f us a part beyond the bound, %.0f%% of the bound",
                 cell["mode"], cell["step_ms_median"], len(cell["step_ms_all"]), cell["per_part_beyond_bound_us"],
                 100 * cell["of_bound"])
    if args.json:
        write_json(args.json, rounded(result))


if __name__ == "__main__":
    main()
