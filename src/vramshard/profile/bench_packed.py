"""A dense FFN on the CPU from oneDNN-prepacked weights against the plain ones, by rows; and through the C
kernel's matrix tiles (:func:`measure_tiles_ffn`).

With ``VRAMSHARD_CPU_PACKED`` the executor computes dense FFNs on the CPU (whole, or a split FFN's
CPU part) from weights reordered once into oneDNN's layout (:mod:`~vramshard.runtime.cpu_packed`).
The matmul tables time plain weights. On the H200 machine the packed parts took 21% (1 row) and
26% (64 rows) less time than plain ones in a llama3-8b step (thirteenth session), and single
projections 0.67-1.42× (by projection and rows): a factor per row count, measured with the
executor's own code, that the estimator applies to dense FFNs on the CPU when packing is on.
"""

from __future__ import annotations

import math

import torch

from ..layers import cpu_gemv
from ..layers.mlp import _swiglu
from ..runtime.cpu_packed import PackedPart
from ..runtime.host_weights import pack_sublayer
from .bench_matmul import cold_bytes, cycling, settled
from .bench_split import MAX_LAYERS, split_ffn
from .progress import ProgressSink
from .spec import torch_dtype
from .timing import time_cpu


def measure_packed_ffn(dtype: str, hidden: int, intermediate: int, rows: list[int], budget_s: float,
                       progress: ProgressSink, weight: float) -> dict[str, float] | None:
    """{rows: packed time over plain} of a whole dense FFN's contribution, over cold weights;
    None where oneDNN cannot pack or run this dtype here (the executor then runs plain too)."""
    progress.step(f"cpu packed FFN {dtype} [{hidden} x {intermediate}]")
    dt = torch_dtype(dtype)
    ffn = split_ffn(hidden, intermediate, dt)
    layer_bytes = 3 * hidden * intermediate * dt.itemsize
    layers = max(2, min(MAX_LAYERS, math.ceil(cold_bytes("cpu") / layer_bytes)))  # cycled: cold reads
    plain = []
    for _ in range(layers):
        weights = {spec.source: (torch.randn(spec.shape) * 0.02).to(dt) if len(spec.shape) > 1
                   else torch.ones(spec.shape, dtype=dt) for spec in ffn.weights}
        plain.append(pack_sublayer(ffn, weights, pin=False, splittable=False).views)
    factors: dict[str, float] = {}
    with torch.inference_mode():
        try:
            packed = [PackedPart(views, rows[0]) for views in plain]
            packed[0].contribution(torch.zeros(1, hidden, dtype=dt))
        except RuntimeError:
            progress.advance(weight)
            return None
        for m in rows:
            h = ffn.norm(plain[0], torch.randn(m, hidden).to(dt))
            t_plain = time_cpu(settled(cycling(layers, lambda i: ffn.contribution(plain[i], h))), budget_s)
            t_packed = time_cpu(cycling(layers, lambda i: packed[i].contribution(h)), budget_s)
            factors[str(m)] = t_packed / t_plain
    progress.advance(weight)
    return factors


def tiles_rows(rows: list[int]) -> list[int]:
    """Of the packed factors' ``rows``, those whose FFN work the C kernel's matrix tiles would compute."""
    return [m for m in rows if cpu_gemv.FFN_ROWS < m <= cpu_gemv.AMX_ROWS]


def measure_tiles_ffn(dtype: str, hidden: int, intermediate: int, rows: list[int], budget_s: float,
                      progress: ProgressSink, weight: float) -> dict[str, float] | None:
    """{rows: time through the C kernel's matrix tiles over torch's} of a whole dense FFN's contribution (bf16, by
    rows: :func:`~vramshard.layers.cpu_gemv.amx_computes`, ``VRAMSHARD_CPU_AMX``), over cold weights; None where the
    tiles are not here or take no such rows. Measured whether or not they are switched on, so that a profile
    prices them once they are."""
    rows = tiles_rows(rows)
    if dtype != "bf16" or not rows or not cpu_gemv.tiles_here():
        return None
    progress.step(f"cpu FFN through the matrix tiles {dtype} [{hidden} x {intermediate}]")
    dt = torch_dtype(dtype)
    layer_bytes = 3 * hidden * intermediate * dt.itemsize
    layers = max(2, min(MAX_LAYERS, math.ceil(cold_bytes("cpu") / layer_bytes)))  # cycled: cold reads
    plain = []
    for _ in range(layers):
        gate, up, down = ((torch.randn(n, k) * 0.02).to(dt) for n, k in
                          ((intermediate, hidden), (intermediate, hidden), (hidden, intermediate)))
        plain.append((gate, up, down))
    factors: dict[str, float] = {}
    with torch.inference_mode():
        for m in rows:
            h = torch.randn(m, hidden).to(dt)
            t_plain = time_cpu(settled(cycling(layers, lambda i: _swiglu(h, *plain[i]))), budget_s)
            t_tiles = time_cpu(cycling(layers, lambda i: cpu_gemv.swiglu(h, *plain[i])), budget_s)
            factors[str(m)] = t_tiles / t_plain
    progress.advance(weight)
    return factors
