"""The routed-experts kernel called back to back, and after a pause like the GPU's part of a layer.

    PYTHONPATH=src python -m benchmarks.kernel_gap [--gaps 0,0.4,2] [--threads 15] [--json FILE]

In an ``experts-cpu`` decode step the run-ahead worker computes a layer's routed experts, then waits
while the GPU adds them, runs the next attention and router and sends the next hidden state (about
0.4 ms a layer in the thirty-second GPU session's Qwen3-30B-A3B steps: 66.8 ms a step, of which the
worker's kernel 46.7 ms over 48 layers). There the kernel took 0.97 ms a layer, against 0.79 ms in
``benchmarks.cpu_experts``, which calls it back to back. One explanation is the kernel's OpenMP team
going to sleep in the pause (libgomp spins ``GOMP_SPINCOUNT`` polls, then waits in the kernel) and
waking for each layer. This times one token's routed experts of one layer (``--shape``, drawn at
random from the layer's, cold: ``--layers`` copies in turn) after each pause of ``--gaps`` ms, the
calling thread spinning through the pause as the worker polls its ready word; the bound is the
experts' bytes at the host's read rate, measured before and after. Run it under
``GOMP_SPINCOUNT=...`` or ``OMP_WAIT_POLICY=...`` to compare the team's wait policies (libgomp reads
them when the process starts).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time

import torch

from vramshard.layers import cpu_gemv

from .common import cpu_read_bandwidth, hardware, now, one_token_experts, rounded, write_json

log = logging.getLogger("kernel_gap")


def time_after_gaps(call, gaps_s: list[float], calls: int) -> dict[float, list[float]]:
    """{gap: seconds of each ``call()``} with the calling thread spinning ``gap`` seconds before each,
    the gaps interleaved call by call (a slow spell of the host falls on every gap alike)."""
    out: dict[float, list[float]] = {gap: [] for gap in gaps_s}
    for _ in range(calls):
        for gap in gaps_s:
            end = time.perf_counter() + gap
            while time.perf_counter() < end:
                pass
            began = time.perf_counter()
            call()
            out[gap].append(time.perf_counter() - began)
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--gaps", default="0,0.4,2", help="pauses before each call, ms")
    parser.add_argument("--threads", type=int, default=None, help="the kernel's team (default: torch's)")
    parser.add_argument("--layers", type=int, default=6, help="copies of the layer's experts walked in turn")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if not cpu_gemv.computes(1):
        raise SystemExit("the C kernel does not build here")
    if args.threads:
        torch.set_num_threads(args.threads)
    call, expert_bytes = one_token_experts(args.shape, args.layers)
    read_before = cpu_read_bandwidth()
    gaps = [float(g) / 1e3 for g in args.gaps.split(",")]
    time_after_gaps(call, gaps, 10)  # warm-up
    times = time_after_gaps(call, gaps, args.calls)
    read_bps = max(read_before, cpu_read_bandwidth())
    bound_s = expert_bytes / read_bps
    cells = []
    for gap, seconds in times.items():
        cell = {"gap_ms": gap * 1e3, "median_ms": statistics.median(seconds) * 1e3,
                "p25_ms": sorted(seconds)[len(seconds) // 4] * 1e3, "bound_ms": bound_s * 1e3}
        cell["of_bound"] = cell["bound_ms"] / cell["median_ms"]
        log.info("%s", rounded(cell))
        cells.append(rounded(cell))
    result = {"date": now(), "hardware": hardware(), "shape": args.shape, "threads": torch.get_num_threads(),
              "read_gb_s": read_bps / 1e9, "env": {name: os.environ.get(name) for name in
                                                     ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")},
              "cells": cells}
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
