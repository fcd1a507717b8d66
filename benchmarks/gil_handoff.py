"""A CPU part on a worker thread while another thread runs Python: what the GIL costs it.

    PYTHONPATH=src python -m benchmarks.gil_handoff --shape llama3-8b --rows 1,64 --json out.json

The run-ahead worker (``runtime/run_ahead.py``) computes split FFNs' CPU parts while the host
thread queues the step's GPU work, in Python. The part's torch calls release the GIL, but between
them the worker needs it back, and a thread that asks for the GIL while another runs Python waits
for the interpreter's switch interval (5 ms by default) before the holder lets go. On the GPU
machine (thirteenth session) run-ahead steps were slower than plain ones (llama3-8b at 64 rows:
167 ms against 121), their CPU parts 1.7× as long.

For one split part of the shape (a quarter of the FFN's width: gate+up, SiLU·up, down), at each row
count: the part alone on this thread (the baseline), the part on a worker beside a thread that runs
Python all the time, at several switch intervals, and the part's weight bytes at the CPU read
bandwidth measured in the same run (the bound). Then, at 0.1 ms, beside a host thread that also
wakes its own OpenMP team every 0.5 ms (a small torch op), with the worker on all threads and on
one fewer. Run it with ``OMP_WAIT_POLICY=PASSIVE`` too: the result says which policy it ran under. Weights are cycled over copies that exceed the
last-level cache, as the executor reads them.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import statistics
import time

import torch
import torch.nn.functional as F

from vramshard.profile.bench_matmul import cold_bytes
from vramshard.shapes import shape_config

from .common import beside_python, cpu_read_bandwidth, hardware, now, rounded, write_json

log = logging.getLogger("gil_handoff")

INTERVALS_S = (5e-3, 1e-3, 2e-4, 1e-4, 5e-5)


def part_weights(hidden: int, width: int, dtype: torch.dtype, copies: int) -> list[dict[str, torch.Tensor]]:
    """``copies`` sets of one CPU part's weights: gate and up [width, hidden], down [hidden, width]."""
    return [{name: (torch.randn(*shape) * 0.02).to(dtype)
             for name, shape in (("gate", (width, hidden)), ("up", (width, hidden)), ("down", (hidden, width)))}
            for _ in range(copies)]


def part(h: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    """The part's contribution for ``h`` [T, hidden], as the plain CPU path computes it."""
    return F.linear(F.silu(F.linear(h, w["gate"])) * F.linear(h, w["up"]), w["down"])


def median_part_s(h: torch.Tensor, sets: list[dict[str, torch.Tensor]], repeats: int) -> float:
    """Median seconds of one part, each call reading the next set of weights (after a warm-up)."""
    part(h, sets[0])
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        part(h, sets[(i + 1) % len(sets)])
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def beside_host(h: torch.Tensor, sets: list[dict[str, torch.Tensor]], repeats: int, interval_s: float,
                worker_threads: int | None = None, host_op_every_s: float | None = None) -> float:
    """Median seconds of one part on a worker thread (``worker_threads``, default this thread's
    count) while this thread runs Python throughout and, every ``host_op_every_s``, a small torch
    op on its own OpenMP team (as the host thread's CPU work between launches wakes that team)."""
    a, b = torch.ones(1 << 22), torch.empty(1 << 22)  # 16 MiB: split over the host thread's team
    last = [time.perf_counter()]

    def host_op():
        if host_op_every_s is not None and time.perf_counter() - last[0] > host_op_every_s:
            torch.add(a, 1, out=b)
            last[0] = time.perf_counter()

    return beside_python(lambda: median_part_s(h, sets, repeats), interval_s, worker_threads, host_op)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rows", default="1,64")
    parser.add_argument("--share", type=float, default=0.25, help="the part's share of the FFN's width")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    config = shape_config(args.shape)
    dtype = getattr(torch, args.dtype)
    hidden = config["hidden_size"]
    width = max(1, int(config["intermediate_size"] * args.share))
    weight_bytes = 3 * hidden * width * dtype.itemsize
    copies = max(2, min(8, math.ceil(cold_bytes("cpu") / weight_bytes)))
    read_gb_s = cpu_read_bandwidth() / 1e9
    result = {"date": now(), "hardware": hardware(), "shape": args.shape, "dtype": args.dtype, "width": width,
              "threads": torch.get_num_threads(), "cpu_read_gb_s": read_gb_s,
              "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "cells": []}
    sets = part_weights(hidden, width, dtype, copies)
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            h = (torch.randn(rows, hidden) * 0.1).to(dtype)
            cell = {"rows": rows, "read_bound_ms": weight_bytes / (read_gb_s * 1e9) * 1e3,
                    "alone_ms": median_part_s(h, sets, args.repeats) * 1e3}
            for interval in INTERVALS_S:
                cell[f"beside_python_{interval * 1e6:.0f}us_ms"] = beside_host(h, sets, args.repeats, interval) * 1e3
            # At the run-ahead worker's interval: the host thread's own OpenMP team woken every
            # 0.5 ms, with the worker on all threads and on one fewer (runtime/run_ahead.worker_threads).
            every = 5e-4
            cell["beside_python_and_host_ops_ms"] = beside_host(h, sets, args.repeats, 1e-4, None, every) * 1e3
            cell["beside_python_and_host_ops_one_fewer_ms"] = beside_host(
                h, sets, args.repeats, 1e-4, max(1, torch.get_num_threads() - 1), every) * 1e3
            log.info("%s", rounded(cell))
            result["cells"].append(cell)
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
