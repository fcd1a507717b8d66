"""A dense FFN's CPU work of a few rows: projection by projection against one compiled function.

    PYTHONPATH=src python -m benchmarks.cpu_swiglu --rows 1,4,16,64 --json out.json

The two ways :mod:`vramshard.layers.cpu_swiglu` chooses between, on weights laid out as the engine
holds them (``pack_sublayer``: a whole FFN with gate and up stacked, or a split FFN's first pieces
with down stored transposed), cycled over copies beyond the last-level cache as a step reads a
model's layers:

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
from vramshard.profile.bench_split import split_ffn
from vramshard.runtime.host_weights import pack_sublayer

from .common import beside_python, cpu_read_bandwidth, hardware, now, rounded, write_json

log = logging.getLogger("cpu_swiglu")

# (name, hidden, intermediate, pieces of 16 on the CPU; None: the whole FFN)
PARTS = (("llama3-8b whole", 4096, 14336, None), ("llama3-8b quarter", 4096, 14336, 4),
         ("nemo-8b whole", 5120, 14336, None), ("nemo-8b quarter", 5120, 14336, 4),
         ("qwen2.5-1.5b whole", 1536, 8960, None))
WORKER_INTERVAL_S = 1e-4  # runtime/run_ahead.SWITCH_INTERVAL_S
COUNTING_INTERVAL_S = 0.05


def part_copies(hidden: int, intermediate: int, pieces: int | None, dtype: torch.dtype) -> tuple[list[dict], int]:
    """Copies of the part's weights as the engine packs them, together beyond the last-level cache,
    and the part's weight bytes."""
    ffn = split_ffn(hidden, intermediate, dtype)
    layer_bytes = 3 * hidden * intermediate * dtype.itemsize
    copies = max(2, min(8, math.ceil(cold_bytes("cpu") / layer_bytes)))
    parts = []
    for _ in range(copies):
        weights = {spec.source: (torch.randn(spec.shape) * 0.02).to(dtype) if len(spec.shape) > 1
                   else torch.ones(spec.shape, dtype=dtype) for spec in ffn.weights}
        views = pack_sublayer(ffn, weights, pin=False, splittable=pieces is not None).views
        parts.append(views if pieces is None else ffn.pieces_of(views, 0, pieces))
    share = 1.0 if pieces is None else pieces / ffn.num_pieces
    return parts, int(layer_bytes * share)


def ways(parts: list[dict], rows: int, hidden: int, dtype: torch.dtype) -> dict:
    """The two ways over the copies, as the engine calls them at ``rows`` rows."""
    def weights(i: int):
        w = parts[i % len(parts)]
        if "gate_up_proj" in w:  # a whole FFN: gate and up stacked
            return (w["gate_up_proj"], w["down_proj"]), (*w["gate_up_proj"].chunk(2, dim=0), w["down_proj"])
        return ((w["gate_proj"], w["up_proj"], w["down_proj"]),) * 2

    fused = "gate_up_proj" in parts[0]
    if rows <= cpu_linear.MAX_TOKENS:
        plain = mlp._swiglu_fused if fused else mlp._swiglu
        projections = lambda h, i: plain(h, *weights(i)[0])  # noqa: E731
    else:  # the executor's buffers (runtime/ffn_buffers.py): products in ``work``, the result in ``out``
        into = mlp._swiglu_fused_into if fused else mlp._swiglu_into
        width = weights(0)[1][0].shape[0]
        out, work = torch.empty(rows, hidden, dtype=dtype), torch.empty(2 * rows * width, dtype=dtype)
        projections = lambda h, i: into(h, *weights(i)[0], out, work)  # noqa: E731
    return {"projections": projections, "compiled": lambda h, i: cpu_swiglu.compiled(h, *weights(i)[1])}


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
    parser.add_argument("--parts", default=None, help="only the parts whose names contain one of these "
                        "(comma-separated), e.g. 'llama3-8b quarter'")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    threads = torch.get_num_threads()
    worker_threads = max(1, threads - 1)
    read_gb_s = cpu_read_bandwidth() / 1e9
    result = {"date": now(), "hardware": hardware(), "dtype": args.dtype, "threads": threads,
              "worker_threads": worker_threads, "cpu_read_gb_s": read_gb_s, "cells": []}
    wanted = args.parts.split(",") if args.parts else None
    for name, hidden, intermediate, pieces in PARTS:
        if wanted and not any(w in name for w in wanted):
            continue
        parts, weight_bytes = part_copies(hidden, intermediate, pieces, dtype)
        with torch.inference_mode():
            cpu_swiglu.warm_up(dtype)
            for rows in (int(r) for r in args.rows.split(",")):
                h = (torch.randn(rows, hidden) * 0.1).to(dtype)
                calls = ways(parts, rows, hidden, dtype)
                cpu_linear.settle(lambda: calls["projections"](h, 0))  # (the projections' paths chosen)
                cell = {"part": name, "hidden": hidden, "intermediate": intermediate, "pieces": pieces,
                        "rows": rows, "read_bound_ms": weight_bytes / (read_gb_s * 1e9) * 1e3}
                for way, call in calls.items():
                    alone = cell[f"{way}_alone_ms"] = median_ms(call, h, args.repeats)
                    cell[f"{way}_alone_gb_s"] = weight_bytes / alone / 1e6
                    cell[f"{way}_beside_python_ms"] = beside_python_ms(call, h, args.repeats, WORKER_INTERVAL_S,
                                                                       worker_threads)
                    waited = beside_python_ms(call, h, 3, COUNTING_INTERVAL_S, worker_threads)
                    cell[f"{way}_gil_waits"] = max(0.0, waited - alone) / (COUNTING_INTERVAL_S * 1e3)
                log.info("%s", rounded(cell))
                result["cells"].append(cell)
        del parts
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
