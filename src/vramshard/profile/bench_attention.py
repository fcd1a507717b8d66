"""Attention micro-benchmark: ``scaled_dot_product_attention`` with grouped KV heads.

``n_new`` query tokens attend to ``context`` cached keys (no mask: the full rectangle, an
upper bound for a causal prefill chunk).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .bench_matmul import repair_row
from .progress import ProgressSink
from .spec import torch_dtype
from .timing import time_cpu, time_cuda


def sdpa_gqa(q, k, v):
    """Attention of q [1, H, T, D] to k, v [1, Hkv, L, D] as the executor computes it: one new
    token through :func:`~vramshard.layers.attention.decode_attention` (query heads as rows of
    their KV head), more through SDPA's GQA broadcast (repeated KV heads where torch lacks it)."""
    if q.shape[2] == 1:
        from ..layers.attention import decode_attention

        return decode_attention(q[:, :, 0], k, v, q.shape[-1] ** -0.5)
    try:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    except TypeError:
        group = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))


def measure_attention(
    device: str, dtype: str, heads: int, kv_heads: int, head_dim: int, n_new_list, context_list, *,
    budget_s: float, cap_s: float, progress: ProgressSink, label: str, weight: float,
) -> dict:
    """Seconds on the ``n_new`` × ``context`` grid; returns the table's fields."""
    torch_dt = torch_dtype(dtype)
    n_new_list = sorted(int(n) for n in n_new_list)
    context_list = sorted(int(c) for c in context_list)
    seconds: list[list[float]] = []
    estimated = 0
    peak_flops = 0.0

    def run(n_new: int, context: int) -> float:
        q = torch.randn(1, heads, n_new, head_dim, dtype=torch_dt, device=device)  # [B, H, T, D]
        k = torch.randn(1, kv_heads, context, head_dim, dtype=torch_dt, device=device)  # [B, Hkv, C, D]
        v = torch.randn_like(k)
        fn = lambda: sdpa_gqa(q, k, v)  # noqa: E731
        return time_cuda(fn, budget_s) if device == "cuda" else time_cpu(fn, budget_s)

    for n_new in n_new_list:
        row: list[float] = []
        measured: list[bool] = []
        for col, context in enumerate(context_list):
            progress.step(f"{label} new={n_new} context={context}")
            flops = 4.0 * n_new * context * heads * head_dim
            # The first context of each row is always run: attention is linear in context,
            # not in new tokens (small n_new is memory-bound), so only rows extrapolate well.
            predicted = row[-1] * context / context_list[col - 1] if row else 0.0
            if predicted > cap_s and peak_flops > 0:
                row.append(max(row[-1], flops / peak_flops))
                measured.append(False)
                estimated += 1
            else:
                row.append(run(n_new, context))
                measured.append(True)
                peak_flops = max(peak_flops, flops / row[-1])
            progress.advance(weight)
        repair_row(row, measured, lambda j: run(n_new, context_list[j]))
        seconds.append(row)
    return {
        "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
        "n_new": n_new_list, "context": context_list, "seconds": seconds, "estimated": estimated,
    }
