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
