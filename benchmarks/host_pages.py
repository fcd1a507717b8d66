"""Weights in host memory on 4 KiB pages against 2 MiB pages, read by the C kernel and by torch, in one
process run.

    PYTHONPATH=src python -m benchmarks.host_pages [--json FILE]

The engine's host weights sit in anonymous maps (:func:`vramshard.runtime.pinned_host.host_empty`, and the
pinned buffers beside a GPU): private maps advised to take 2 MiB pages since session 36. Until then the
pinned ones were shared maps (``mmap``'s default), which most kernels back with 4 KiB pages only
(``/sys/kernel/mm/transparent_hugepage/shmem_enabled``: ``never``), and a CPU-only engine's came from
``torch.empty`` (4 KiB pages where transparent huge pages are ``madvise``, the common default). This
puts eight copies of an 8B model's gate/up weight (117 MB each, bf16) in each kind of buffer and times,
alternating between them, one-row products by the C kernel (:func:`cpu_gemv.rows_times_weight`) and a
float16 sum (``torch.sum``, the profile's way of timing the host's read), each walking the eight copies,
so every call reads from memory. It reports GB/s and the huge pages the process holds.
"""

from __future__ import annotations

import argparse
import logging
import mmap
import statistics
import time

import torch

from vramshard.layers import cpu_gemv
from vramshard.runtime.pinned_host import host_empty

from .common import hardware, now, write_json

log = logging.getLogger("host_pages")

N, K, COPIES = 14336, 4096, 8


def shared_map(nbytes: int) -> torch.Tensor:
    """The buffer as the pinned host weights had it until session 36: a shared anonymous map, advised."""
    memory = mmap.mmap(-1, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(memory, dtype=torch.uint8)[:nbytes]


def huge_pages_kb() -> int:
    with open("/proc/self/smaps_rollup") as rollup:
        return sum(int(line.split()[1]) for line in rollup if line.startswith(("AnonHugePages:", "ShmemPmdMapped:")))


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=12)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    source = (torch.randn(N, K) * 0.02).to(torch.bfloat16)
    nbytes = source.numel() * source.element_size()
    kinds = {"torch.empty": lambda n: torch.empty(n, dtype=torch.uint8), "shared map": shared_map,
             "private map (host_empty)": host_empty}
    weights, pages = {}, {}
    for name, make in kinds.items():
        before = huge_pages_kb()
        weights[name] = [make(nbytes).view(torch.bfloat16).view(N, K).copy_(source) for _ in range(COPIES)]
        pages[name] = (huge_pages_kb() - before) / (COPIES * nbytes / 1024)
    x = torch.randn(1, K).to(torch.bfloat16)

    def kernel(ws):
        for w in ws:
            cpu_gemv.rows_times_weight(x, w)

    def total(ws):
        for w in ws:
            w.view(torch.float16).sum()

    times = {(name, what): [] for name in kinds for what in ("kernel", "sum")}
    for _ in range(args.repeat):
        for name, ws in weights.items():
            for what, walk in (("kernel", kernel), ("sum", total)):
                began = time.perf_counter()
                walk(ws)
                times[name, what].append((time.perf_counter() - began) / COPIES)
    cells = []
    for name in kinds:
        cell = {"buffer": name, "huge_page_share": round(pages[name], 3)}
        for what in ("kernel", "sum"):
            cell[f"{what}_gb_s"] = round(nbytes / statistics.median(times[name, what][2:]) / 1e9, 2)
        cells.append(cell)
        log.info("%s", cell)
    result = {"date": now(), "hardware": hardware(), "threads": torch.get_num_threads(), "cpu_gemv": cpu_gemv.isa(),
              "weight_mb": nbytes / 1e6, "cells": cells}
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
