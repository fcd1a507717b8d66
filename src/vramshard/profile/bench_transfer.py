"""PCIe micro-benchmark: pinned host↔device copy time by transfer size."""

from __future__ import annotations

import torch

from .progress import ProgressSink
from .timing import time_cuda


def measure_transfers(
    sizes, direction: str, *, budget_s: float, progress: ProgressSink, label: str, weight: float,
) -> dict:
    """Seconds per copy of each size in ``sizes`` (bytes), ``direction`` "h2d" or "d2h"."""
    sizes = sorted(int(s) for s in sizes)
    host = torch.empty(sizes[-1], dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(sizes[-1], dtype=torch.uint8, device="cuda")
    seconds = []
    for size in sizes:
        progress.step(f"{label} {size // 1024} KiB")
        src, dst = (host[:size], dev[:size]) if direction == "h2d" else (dev[:size], host[:size])
        seconds.append(time_cuda(lambda: dst.copy_(src, non_blocking=True), budget_s, max_reps=200))
        progress.advance(weight)
    del host, dev
    return {"bytes": sizes, "seconds": seconds}


def faster_of(first: dict, second: dict) -> dict:
    """Two tables of :func:`measure_transfers` over the same sizes, each size's faster time kept: another
    tenant of the host's memory or PCIe only ever slows a copy. (On an H100 host, session 48's profile timed
    host-to-device copies alone at 21-45 GB/s from 256 KiB to 256 MiB, where the same copies beside a busy
    CPU measured right after ran at 34-55 and every other stored profile of the H100 and H200 hosts had 31-55.)"""
    if first["bytes"] != second["bytes"]:
        raise ValueError(f"transfer tables of different sizes: {first['bytes']} and {second['bytes']}")
    return {"bytes": list(first["bytes"]), "seconds": [min(a, b) for a, b in zip(first["seconds"], second["seconds"])]}
