"""Pinned host memory: exact-size registration (``runtime/pinned_host``) against torch's allocator.

    PYTHONPATH=src python -m benchmarks.pinned_host --json pinned.json

For the host buffers of one Llama-3-8B bf16 layer's FFN (352 MB) and attention (84 MB), and a
nemo-8b FFN (440 MB): the process's resident memory each allocation adds (pinned pages are
resident), the time to allocate and pin, the host-to-device copy rate from it (the physical
figure streaming depends on) and the rate at which the CPU reads it in a one-token bf16 product
(the exact buffers ask for transparent huge pages), for both ways in one process. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import torch

from vramshard.runtime.pinned_host import pinned_empty

from .common import hardware, now, write_json

log = logging.getLogger("pinned_host")
MB = 10**6
SIZES = {"llama3-8b FFN": 3 * 4096 * 14336 * 2, "llama3-8b attention": 4096 * (4096 + 2 * 1024 + 4096) * 2,
         "nemo-8b FFN": 3 * 5120 * 14336 * 2}


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(way: str, nbytes: int, copies: int = 5) -> dict:
    before = resident_bytes()
    start = time.perf_counter()
    host = pinned_empty(nbytes) if way == "exact" else torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    alloc_s = time.perf_counter() - start
    grew = resident_bytes() - before
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    device.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(copies):
        device.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    rate = copies * nbytes / (time.perf_counter() - start) / 1e9
    same = bool(torch.equal(device[:4096].cpu(), host[:4096]))
    weight = host[: nbytes // 8192 * 8192].view(torch.bfloat16).view(-1, 4096)  # rows of 4096 bf16
    x = torch.zeros(1, 4096, dtype=torch.bfloat16)
    torch.nn.functional.linear(x, weight)
    start = time.perf_counter()
    for _ in range(copies):
        torch.nn.functional.linear(x, weight)
    gemv = copies * weight.nbytes / (time.perf_counter() - start) / 1e9
    del host, device, weight
    return {"way": way, "bytes": nbytes, "resident_growth_bytes": grew, "growth_over_size": grew / nbytes,
            "alloc_and_fill_s": alloc_s, "h2d_gb_s": rate, "cpu_gemv_gb_s": gemv, "same": same}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("pinned_host needs a CUDA GPU")
    torch.cuda.init()
    cells = []
    for name, nbytes in SIZES.items():
        for way in ("torch", "exact"):
            cell = {"buffer": name, **measure(way, nbytes)}
            cells.append(cell)
            log.info("%-20s %-5s %7.1f MB: resident +%7.1f MB (%.2fx), %.2f s to allocate and fill, H2D %.1f GB/s, "
                     "CPU GEMV reads %.1f GB/s", name, way, nbytes / MB, cell["resident_growth_bytes"] / MB,
                     cell["growth_over_size"], cell["alloc_and_fill_s"], cell["h2d_gb_s"], cell["cpu_gemv_gb_s"])
    if args.json:
        write_json(args.json, {"date": now(), "hardware": hardware(), "cells": cells})


if __name__ == "__main__":
    main()
