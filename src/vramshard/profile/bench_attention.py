"""Attention micro-benchmark: ``scaled_dot_product_attention`` with grouped KV heads.

``n_new`` query tokens attend to ``context`` cached keys (no mask: the full rectangle, an
upper bound for a causal prefill chunk).

On the CPU the keys and values are read as a step reads them: views of a paged cache's rows
([context, Hkv, D], transposed, not contiguous), a different copy in each timed call, the copies
together larger than twice the last-level cache, as every layer of a step reads its own cache
from memory. Timed hot and contiguous (before 2026-12-04) one-token attention took 1.9-2.5x less
on the 2-core development machine than this (``benchmarks/cpu_attention``), and the H200 machine's
measured steps replay best with the old figures x2.2 (``benchmarks/replay_studies attention``;
docs/BENCHMARKS.md, session 24). On the GPU the tensors stay
contiguous and hot (its decode kernels read the paged cache in place; not yet re-timed).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .bench_matmul import MAX_COPIES, cold_bytes, cycling, repair_row
from .progress import ProgressSink
from .spec import torch_dtype
from .timing import StealGuard, time_cpu, time_cuda


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


def cold_kv_ring(largest_cache: int, dtype) -> torch.Tensor:
    """A flat CPU buffer of at least twice the last-level cache (:func:`cold_bytes`) and two caches
    of ``largest_cache`` elements, from which :func:`cycling_cache_reads` cuts its copies. Filled with
    a repeated random pattern (filling it all at random would take seconds of a quick profile)."""
    chunk = 1 << 16
    elements = max(cold_bytes("cpu") // torch.tensor([], dtype=dtype).element_size(), 2 * largest_cache)
    ring = torch.empty(-(-elements // chunk), chunk, dtype=dtype)
    ring.copy_(torch.randn(chunk).to(dtype).expand_as(ring))
    return ring.view(-1)


def cycling_cache_reads(q: torch.Tensor, ring: torch.Tensor, kv_heads: int, context: int, head_dim: int):
    """Attention of ``q`` [1, H, T, D] over the next of the ring's cache copies at each call: keys
    and values [context, Hkv, D] each, viewed [1, Hkv, context, D] as the executor reads its cache."""
    per = context * kv_heads * head_dim
    copies = max(1, min(MAX_COPIES, ring.numel() // (2 * per)))

    def cache(i: int) -> torch.Tensor:  # the i-th [context, Hkv, D] rows, viewed [1, Hkv, context, D]
        return ring[i * per:(i + 1) * per].view(context, kv_heads, head_dim).transpose(0, 1)[None]

    caches = [(cache(2 * i), cache(2 * i + 1)) for i in range(copies)]  # (keys, values), viewed once
    return cycling(copies, lambda i: sdpa_gqa(q, *caches[i]))


def measure_attention(
    device: str, dtype: str, heads: int, kv_heads: int, head_dim: int, n_new_list, context_list, *,
    budget_s: float, cap_s: float, progress: ProgressSink, label: str, weight: float,
    steal_guard: StealGuard | None = None,
) -> dict:
    """Seconds on the ``n_new`` × ``context`` grid; returns the table's fields (on the CPU timed
    through ``steal_guard`` where given)."""
    torch_dt = torch_dtype(dtype)
    timed_cpu = steal_guard.time if steal_guard is not None else time_cpu
    n_new_list = sorted(int(n) for n in n_new_list)
    context_list = sorted(int(c) for c in context_list)
    seconds: list[list[float]] = []
    estimated = 0
    peak_flops = 0.0

    ring = cold_kv_ring(kv_heads * head_dim * max(context_list), torch_dt) if device == "cpu" else None

    def run(n_new: int, context: int) -> float:
        q = torch.randn(1, heads, n_new, head_dim, dtype=torch_dt, device=device)  # [B, H, T, D]
        if ring is not None:
            return timed_cpu(cycling_cache_reads(q, ring, kv_heads, context, head_dim), budget_s)
        k = torch.randn(1, kv_heads, context, head_dim, dtype=torch_dt, device=device)  # [B, Hkv, C, D]
        v = torch.randn_like(k)
        return time_cuda(lambda: sdpa_gqa(q, k, v), budget_s)

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
