"""Fixed cost of dispatching one tiny sub-layer (Python + kernel launches) on each side.

The sub-layer is a norm, two small projections, an activation and a residual on one
token: its arithmetic is negligible, so its time is the per-sub-layer overhead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .timing import time_wall_cuda


def _tiny_sublayer(x, norm_weight, w_up, w_down):
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_weight
    h = F.silu(F.linear(h, w_up))
    return x + F.linear(h, w_down)


def measure_dispatch(device: str, budget_s: float) -> float:
    """Seconds per tiny sub-layer on ``device`` ("cpu" or "cuda"), wall clock."""
    x = torch.randn(1, 64, device=device)  # [T, D]
    norm_weight = torch.ones(64, device=device)
    w_up = torch.randn(128, 64, device=device)
    w_down = torch.randn(64, 128, device=device)
    fn = lambda: _tiny_sublayer(x, norm_weight, w_up, w_down)  # noqa: E731
    # Dispatch costs a few microseconds and every interruption adds to it: take the fastest
    # of many short batches rather than a median (run-to-run spread was ±50% with 3 batches).
    if device == "cuda":
        return time_wall_cuda(fn, budget_s, batches=15, fastest=True)
    return time_cpu_fastest(fn, budget_s)


def time_cpu_fastest(fn, budget_s: float, batches: int = 15) -> float:
    """Lowest per-call wall time over ``batches`` batches of back-to-back calls."""
    import time

    fn()
    start = time.perf_counter()
    fn()
    single = max(time.perf_counter() - start, 1e-7)
    reps = max(1, int(budget_s / batches / single))
    best = float("inf")
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - start) / reps)
    return best
