"""The CPU's decode-sized products by weight layout and kernel form, against the read bound.

    PYTHONPATH=src python -m benchmarks.cpu_layouts --json out.json

Two findings of session 28, measured in one run:

- **down from a splittable FFN**: a plan that splits dense FFNs stores ``down_proj`` transposed
  ([F, D]); the CPU's part reads it as a transposed view. A llama3-8b quarter part's down
  ([4096 × 3584]) at 1, 4, 16 and 64 rows: ``F.linear`` from the transposed view, ``F.linear`` from a
  row-major copy (``runtime/cpu_down.py``), and, at one row, the compiled row sums a row-major copy
  allows (``layers/cpu_linear``'s compiled candidate).
- **the host experts pass**: a Qwen3-30B-A3B layer's routed experts of one token (8 and 3 experts)
  and of 4 and 16 tokens, in the row-parallel form and the form by assignment
  (``layers/host_experts``), each compiled here from the layer's own sizes.

Each cell: the median of ``--repeats`` calls over weight copies beyond the last-level cache, all
torch threads, and the weights' read time at the host's read bandwidth measured in the same run
(for the experts, each assignment's expert bytes once: a step of many tokens reads an expert that
several tokens chose from the cache after the first, so it can beat that figure).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from vramshard.layers import cpu_compiled, cpu_linear, host_experts
from vramshard.profile.bench_matmul import cold_bytes

from .common import cpu_read_bandwidth, hardware, now, rounded, write_json
from .worker_team import filled

log = logging.getLogger("cpu_layouts")


def median_ms(fn, count: int, repeats: int) -> float:
    """Median ms of ``fn(i)`` over ``repeats`` calls, i cycling over ``count`` weight copies (after two
    untimed calls, which compile where needed)."""
    fn(0)
    fn(1 % count)
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        fn(i % count)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def copies(one_bytes: int) -> int:
    return max(2, -(-cold_bytes("cpu") // one_bytes))


def down_cells(dtype: torch.dtype, repeats: int, read_bps: float) -> list[dict]:
    hidden, width = 4096, 14336 // 4
    stored = [filled(width, hidden, dtype=dtype) for _ in range(copies(width * hidden * dtype.itemsize))]
    views = [s.t() for s in stored]  # [D, r], as a splittable FFN's CPU part reads it
    rows_major = [v.contiguous() for v in views]
    bound_ms = width * hidden * dtype.itemsize / read_bps * 1e3
    cells = []
    for rows in (1, 4, 16, 64):
        act = filled(rows, width, dtype=dtype)
        ways = {"linear, transposed view": lambda i: F.linear(act, views[i]),
                "linear, row-major copy": lambda i: F.linear(act, rows_major[i])}
        if rows == 1 and cpu_linear.compiled_allowed():
            ways["compiled row sums, row-major copy"] = lambda i: cpu_linear.KERNELS["compiled"](act, rows_major[i], None)
        for way, fn in ways.items():
            ms = median_ms(fn, len(views), repeats)
            cells.append({"work": "down of a llama3-8b quarter part", "rows": rows, "way": way, "ms": ms,
                          "read_bound_ms": bound_ms})
            log.info("down %2d rows, %-36s %7.3f ms (read bound %.3f)", rows, way, ms, bound_ms)
    return cells


def expert_cells(dtype: torch.dtype, repeats: int, read_bps: float) -> list[dict]:
    experts, inter, hidden = 128, 768, 2048
    per = 3 * inter * hidden
    layers = []
    for _ in range(copies(experts * per * dtype.itemsize)):
        buffer = filled(experts * per, dtype=dtype)  # each expert's gate_up then down, as a host buffer packs them
        layers.append((buffer.as_strided((experts, 2 * inter, hidden), (per, hidden, 1)),
                       buffer[2 * inter * hidden:].as_strided((experts, hidden, inter), (per, inter, 1))))
    generator = torch.Generator().manual_seed(0)
    cells = []
    for tokens, k in ((1, 8), (1, 3), (4, 8), (16, 8)):
        h = filled(tokens, hidden, dtype=dtype).float()
        routed = [torch.stack([torch.randperm(experts, generator=generator)[:k] for _ in range(tokens)]) for _ in range(8)]
        weights = torch.full((tokens, k), 1.0 / k, dtype=dtype)
        # each assignment's expert read once (a step of many tokens reads a repeated expert from the cache)
        bound_ms = tokens * k * per * dtype.itemsize / read_bps * 1e3
        for form, by_assignment in (("row-parallel", False), ("by assignment", True)):
            if tokens == 1:
                kernel = host_experts._one_token_kernel_by_assignment if by_assignment else host_experts._one_token_kernel

                def fn(i, kernel=kernel):
                    return kernel(h, *layers[i % len(layers)], routed[i % 8], weights)
            else:
                kernel = host_experts._kernel_by_assignment if by_assignment else host_experts._kernel

                def fn(i, kernel=kernel):
                    chosen = routed[i % 8]
                    return kernel(h.repeat_interleave(k, dim=0), *layers[i % len(layers)], chosen.reshape(-1))

            ms = median_ms(fn, len(layers) * 8, repeats)
            cells.append({"work": f"experts, {tokens} token(s) x {k}", "form": form, "ms": ms, "assignments_read_ms": bound_ms,
                          "chosen": host_experts.by_assignment(tokens * k) == by_assignment})
            log.info("experts %2d x %d, %-14s %7.3f ms (its assignments read at the bound: %.3f)%s", tokens, k, form, ms, bound_ms,
                     " <- the pass takes this one here" if cells[-1]["chosen"] else "")
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dtype = getattr(torch, args.dtype)
    cpu_compiled.kernels_release_gil()
    cpu_compiled.kernels_read_threads_at_run_time()
    read_bps = cpu_read_bandwidth()
    with torch.inference_mode():
        cells = down_cells(dtype, args.repeats, read_bps) + expert_cells(dtype, args.repeats, read_bps)
    result = {"date": now(), "hardware": hardware(), "dtype": args.dtype, "threads": torch.get_num_threads(),
              "cpu_read_gb_s": read_bps / 1e9, "cells": [rounded(c, 4) for c in cells], "command": " ".join(sys.argv)}
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
