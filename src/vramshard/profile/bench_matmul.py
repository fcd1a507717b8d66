"""Matrix-multiply micro-benchmark: seconds of ``linear(x[M, K], W[N, K])`` on a grid.

:func:`vramshard.layers.sublayer.linear` is the path the executor's projections take on either
device (on the CPU, few-token half-precision shapes use the kernel measured fastest for them).
"""

from __future__ import annotations

import glob
from typing import Callable

import torch

from ..layers import cpu_linear
from ..layers.sublayer import linear
from .progress import ProgressSink
from .spec import torch_dtype
from .timing import StealGuard, time_cpu, time_cuda

# Weights are read from memory, not cache, when the model runs: each timed call uses the
# next of several copies whose total is twice the last-level cache (CPU L3; a GPU's L2 is far
# smaller). The copies of a small weight are many: a MoE expert's 3-6 MB projections cycled
# through only 32 copies (~200 MB) before, which a 300 MiB L3 can hold (benchmarks/cold_weights.py).
MIN_COLD_BYTES = 512 * 2**20
MAX_COPIES = 1024  # weights under MIN_COLD_BYTES / MAX_COPIES are dispatch-bound anyway


def last_level_cache_bytes() -> int:
    """The largest CPU cache (Linux sysfs), 0 where it cannot be read."""
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(path) as f:
                text = f.read().strip().upper()
            scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * scale)
        except (OSError, ValueError):
            continue
    return max(sizes, default=0)


def cold_bytes(device: str = "cpu") -> int:
    """Bytes of weight copies to cycle through on ``device`` so that every read comes from memory."""
    if device == "cpu":
        return max(MIN_COLD_BYTES, 2 * last_level_cache_bytes())
    return MIN_COLD_BYTES  # GPU L2 caches are at most a few hundred MiB below this


def cold_copies(weight: torch.Tensor) -> list[torch.Tensor]:
    """Enough copies of ``weight`` that cycling through them defeats the caches; on the CPU in host memory
    as the engine keeps its weights (:func:`host_copy`)."""
    copies = min(MAX_COPIES, max(1, -(-cold_bytes(weight.device.type) // max(weight.nbytes, 1))))
    if weight.device.type == "cpu":
        return [host_copy(weight) for _ in range(copies)]
    return [weight] + [weight.clone() for _ in range(copies - 1)]


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` copied into a buffer of the engine's host weights (:func:`~vramshard.runtime.pinned_host.host_empty`:
    on 2 MiB pages where the kernel gives them, which the CPU reads faster than torch's 4 KiB ones)."""
    from ..runtime.pinned_host import host_empty

    buffer = host_empty(tensor.nbytes).view(tensor.dtype).view(tensor.shape)
    return buffer.copy_(tensor)


def cycling(count: int, fn: Callable[[int], object]) -> Callable[[], object]:
    """A callable that runs ``fn(i)`` for i = 1, 2, ... modulo ``count``: each timed call reads the
    next of ``count`` copies of the weights (see :func:`cold_copies`)."""
    turn = [0]

    def run():
        turn[0] = (turn[0] + 1) % count
        return fn(turn[0])

    return run


def linear_over(x: torch.Tensor, weights: list[torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``linear(x, w)`` over the ``weights`` copies in turn, with the CPU's path for this shape
    already chosen (:func:`vramshard.layers.cpu_linear.settle`): timings of it time that path."""
    fn = cycling(len(weights), lambda i: linear(x, weights[i]))
    return settled(fn) if x.device.type == "cpu" else fn


def settled(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn``, a CPU benchmark's timed call, once the paths of the projections it makes are chosen
    (:func:`vramshard.layers.cpu_linear.settle`): timings of it then time those paths."""
    cpu_linear.settle(fn)
    return fn


def repair_row(row: list[float], measured: list[bool], remeasure) -> None:
    """Re-measure points slower than the next larger one (time cannot fall as work grows).

    Such a point was hit by a burst of outside load; one more try usually fixes it.
    """
    for j in range(len(row) - 1):
        if measured[j] and row[j] > 1.25 * row[j + 1]:
            row[j] = min(row[j], remeasure(j))


def measure_matmul(
    device: str, dtype: str, shapes, ms, *, budget_s: float, cap_s: float,
    progress: ProgressSink, label: str, weight: float,
    steal_guard: StealGuard | None = None,
) -> dict:
    """Measure ``shapes`` × ``ms`` and return the table's fields.

    Returns ``{"shapes", "m", "seconds", "estimated"}`` where ``seconds[s][j]`` is shape
    ``s`` at ``ms[j]``. A point whose run would take more than ``cap_s`` (predicted from
    the previous M) is not run: it is estimated at the best throughput measured so far in
    this table (never below the previous M's time); ``estimated`` counts those.
    On the CPU ``steal_guard`` times each point (again where a virtual machine's host stole its CPUs).
    """
    torch_dt = torch_dtype(dtype)
    timed_cpu = steal_guard.time if steal_guard is not None else time_cpu
    ms = sorted(int(m) for m in ms)
    shapes = sorted(((int(k), int(n)) for k, n in shapes), key=lambda s: (s[0] * s[1], s))
    seconds: list[list[float]] = []
    estimated = 0
    peak_flops = 0.0  # best FLOP/s measured so far in this table
    for k, n in shapes:
        weight_t = torch.randn(n, k, dtype=torch_dt, device=device) * 0.02  # [N, K]
        weights = cold_copies(weight_t)

        def run(m: int) -> float:
            fn = linear_over(torch.randn(m, k, dtype=torch_dt, device=device), weights)  # x: [M, K]
            return time_cuda(fn, budget_s) if device == "cuda" else timed_cpu(fn, budget_s)

        row: list[float] = []
        measured: list[bool] = []
        for m in ms:
            progress.step(f"{label} M={m} K={k} N={n}")
            flops = 2.0 * m * k * n
            predicted = row[-1] * m / ms[len(row) - 1] if row else 0.0
            if predicted > cap_s and peak_flops > 0:
                row.append(max(row[-1], flops / peak_flops))
                measured.append(False)
                estimated += 1
            else:
                row.append(run(m))
                measured.append(True)
                peak_flops = max(peak_flops, flops / row[-1])
            progress.advance(weight)
        repair_row(row, measured, lambda j: run(ms[j]))
        seconds.append(row)
        del weight_t, weights
    return {"shapes": [list(s) for s in shapes], "m": ms, "seconds": seconds, "estimated": estimated}
