"""A dense FFN's CPU work of a few rows: projection by projection against one compiled function.

    PYTHONPATH=src python -m benchmarks.cpu_swiglu --rows 1,4,16,64 --json out.json

The two ways :mod:`vramshard.layers.cpu_swiglu` chooses between, on the same weights (cycled over
copies beyond the last-level cache, as a step reads a model's layers), for FFN parts of real
shapes:

- ``projections``: the engine's way before: up to 16 rows each projection through the path
  :mod:`vramshard.layers.cpu_linear` chose for its shape (settled before timing), SiLU, product;
  above, the products into reused buffers (``mlp.swiglu_into``'s own way);
- ``compiled``: :func:`vramshard.layers.cpu_swiglu.compiled`, one function compiled by inductor.

Per cell: each way alone on this thread (median ms, GB/s of weights, against the host's read
bandwidth measured in the same run); each way on a worker thread with one thread fewer while this
thread runs Python all the time at the run-ahead worker's switch interval (0.1 ms); and the number
of switch intervals a call waits for the GIL beside that thread at a 50 ms interval (a call's time
there over 50 ms: how often it takes the GIL back).
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import time

import torch

from vramshard.layers import cpu_linear, cpu_swiglu, mlp
from vramshard.profile.bench_matmul import cold_bytes

from .common import beside_python, cpu_read_bandwidth, hardware, now, rounded, write_json

log = logging.getLogger("cpu_swiglu")

# (name, hidden, part rows): a quarter of llama3-8b's FFN (a split part), its whole FFN, nemo-8b's
# quarter, a Qwen3-30B-A3B layer's 8 experts' width, a small part.
SHAPES = (("llama3-8b quarter", 4096, 3584), ("llama3-8b whole", 4096, 14336), ("nemo-8b quarter", 5120, 3584),
          ("qwen3-30b-a3b 8 experts", 2048, 6144), ("small part", 4096, 1024))
WORKER_INTERVAL_S = 1e-4  # runtime/run_ahead.SWITCH_INTERVAL_S
COUNTING_INTERVAL_S = 0.05


def weight_sets(hidden: int, rows: int, dtype: torch.dtype, copies: int) -> list[tuple[torch.Tensor, ...]]:
    """``copies`` sets of (gate [r, D], up [r, D], down [D, r] as a split stores it: transposed)."""
    def weight(*shape):
        return (torch.randn(*shape) * 0.02).to(dtype)

    return [(weight(rows, hidden), weight(rows, hidden), weight(rows, hidden).t()) for _ in range(copies)]


def ways(sets, rows: int, hidden: int, dtype: torch.dtype) -> dict:
    """The two ways over the weight sets, as the engine calls them at ``rows`` rows."""
    if rows <= cpu_linear.MAX_TOKENS:
        projections = lambda h, i: mlp._swiglu(h, *sets[i % len(sets)])  # noqa: E731
    else:  # the executor's buffers (runtime/ffn_buffers.py): products in ``work``, the result in ``out``
        width = sets[0][0].shape[0]
        out, work = torch.empty(rows, hidden, dtype=dtype), torch.empty(2 * rows * width, dtype=dtype)
        projections = lambda h, i: mlp._swiglu_into(h, *sets[i % len(sets)], out, work)  # noqa: E731
    return {"projections": projections, "compiled": lambda h, i: cpu_swiglu.compiled(h, *sets[i % len(sets)])}


def median_ms(call, h: torch.Tensor, repeats: int) -> float:
    for i in range(4):
        call(h, i)
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        call(h, i)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def beside_python_ms(call, h: torch.Tensor, repeats: int, interval_s: float, threads: int) -> float:
    """Median ms of ``call`` on a worker thread (``threads`` threads) while this thread runs Python."""
    return beside_python(lambda: median_ms(call, h, repeats), interval_s, threads)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rows", default="1,4,16,64")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    threads = torch.get_num_threads()
    worker_threads = max(1, threads - 1)
    read_gb_s = cpu_read_bandwidth() / 1e9
    result = {"date": now(), "hardware": hardware(), "dtype": args.dtype, "threads": threads,
              "worker_threads": worker_threads, "cpu_read_gb_s": read_gb_s, "cells": []}
    for name, hidden, width in SHAPES:
        weight_bytes = 3 * hidden * width * dtype.itemsize
        sets = weight_sets(hidden, width, dtype, max(2, min(8, math.ceil(cold_bytes("cpu") / weight_bytes))))
        with torch.inference_mode():
            cpu_swiglu.warm_up(dtype)
            for rows in (int(r) for r in args.rows.split(",")):
                h = (torch.randn(rows, hidden) * 0.1).to(dtype)
                calls = ways(sets, rows, hidden, dtype)
                cpu_linear.settle(lambda: calls["projections"](h, 0))  # (the projections' paths chosen)
                cell = {"shape": name, "hidden": hidden, "width": width, "rows": rows,
                        "read_bound_ms": weight_bytes / (read_gb_s * 1e9) * 1e3}
                for way, call in calls.items():
                    alone = cell[f"{way}_alone_ms"] = median_ms(call, h, args.repeats)
                    cell[f"{way}_alone_gb_s"] = weight_bytes / alone / 1e6
                    cell[f"{way}_beside_python_ms"] = beside_python_ms(call, h, args.repeats, WORKER_INTERVAL_S,
                                                                       worker_threads)
                    waited = beside_python_ms(call, h, 3, COUNTING_INTERVAL_S, worker_threads)
                    cell[f"{way}_gil_waits"] = max(0.0, waited - alone) / (COUNTING_INTERVAL_S * 1e3)
                log.info("%s", rounded(cell))
                result["cells"].append(cell)
        del sets
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
