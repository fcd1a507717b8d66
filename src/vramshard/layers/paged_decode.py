"""Decode attention over the paged KV cache in one Triton kernel (and a small combine).

The fixed-shape decode step (:mod:`~vramshard.layers.static_attention`) otherwise stores the new
key and value with two indexed copies, gathers every row's blocks into a contiguous [B, L, Hkv, D]
buffer (reading and writing the whole context once more), and runs the flash kernel's split-KV
pass and its combine on that copy: seven kernels and three passes over the keys a layer. Here:

- ``_partial`` (grid: rows x KV heads x key splits) reads each row's blocks straight from the
  pool through its block table, the G query heads of one KV head together, with an online
  softmax over its split of the keys; split 0 also stores the row's new key and value, which
  every split reads from its input for the last position instead of from the pool (no race
  between the store and the reads). Splits keep the GPU's multiprocessors busy when rows x KV
  heads are few (one sequence: 8 programs without them).
- ``_combine`` (grid: rows x query heads) merges the splits' partial sums.

The same function as ``store_kv`` followed by ``attend_cached`` (masked softmax attention of
each row's query heads to its first ``position + 1`` keys, float32 accumulation). Needs Triton
and a CUDA tensor (``TRITON_INTERPRET=1`` runs it on the CPU, for tests).
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (CPU-only torch): callers check available()
    triton = None


def available(q: torch.Tensor, block_size: int) -> bool:
    """Whether the kernel takes this step: Triton is installed, q [B, H, D] is on a GPU (or
    Triton's interpreter is on, for tests on the CPU) in half precision, and the head size and
    block size are powers of two of at least 16 (the kernel's tiles)."""
    import os

    head = q.shape[-1]
    return (triton is not None and (q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")
            and q.dtype in (torch.float16, torch.bfloat16) and head >= 16 and head & (head - 1) == 0
            and block_size >= 16 and block_size & (block_size - 1) == 0)


SPLIT_PROGRAMS = 2  # aim for this many programs per multiprocessor over rows x KV heads x splits


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def split_blocks(rows: int, kv_heads: int, blocks: int, device: torch.device) -> int:
    """Blocks of keys per split: enough splits that rows x KV heads x splits fill the GPU about
    ``SPLIT_PROGRAMS`` times over, each split at least one block."""
    sms = _multiprocessors(device.index or 0) if device.type == "cuda" else 8
    splits = max(1, min(blocks, -(-SPLIT_PROGRAMS * sms // (rows * kv_heads))))
    return -(-blocks // splits)


if triton is not None:

    @triton.jit
    def _partial(Q, K_NEW, V_NEW, K_CACHE, V_CACHE, TABLES, POSITIONS, WRITE_INDEX, WRITE_SOURCE,
                 ACC, M, L, scale,
                 stride_qb, stride_qh, stride_nb, stride_nh, stride_cb, stride_cp, stride_ch, stride_tb, stride_i,
                 stride_ab, stride_ah, stride_as, stride_mb, stride_mh,
                 G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                 BLOCKS_PER_SPLIT: tl.constexpr, STORE: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        length = tl.load(POSITIONS + b * stride_i) + 1  # keys this row reads, its new one included
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, D)
        offs_p = tl.arange(0, BS)
        heads = h * G + offs_g
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=(offs_g < G)[:, None], other=0.0)  # [BLOCK_G, D]
        k_new = tl.load(K_NEW + b * stride_nb + h * stride_nh + offs_d)  # [D]
        v_new = tl.load(V_NEW + b * stride_nb + h * stride_nh + offs_d)
        if STORE:
            if s == 0:  # the new key and value into the pool (padded rows repeat row 0's write)
                source = tl.load(WRITE_SOURCE + b * stride_i)
                target = tl.load(WRITE_INDEX + b * stride_i)
                where = (target // BS) * stride_cb + (target % BS) * stride_cp + h * stride_ch + offs_d
                tl.store(K_CACHE + where, tl.load(K_NEW + source * stride_nb + h * stride_nh + offs_d))
                tl.store(V_CACHE + where, tl.load(V_NEW + source * stride_nb + h * stride_nh + offs_d))
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        for j in range(BLOCKS_PER_SPLIT):
            first = (s * BLOCKS_PER_SPLIT + j) * BS
            positions = first + offs_p
            valid = positions < length
            block = tl.load(TABLES + b * stride_tb + s * BLOCKS_PER_SPLIT + j, mask=first < length, other=0)
            where = block * stride_cb + offs_p[:, None] * stride_cp + h * stride_ch + offs_d[None, :]
            k = tl.load(K_CACHE + where, mask=valid[:, None], other=0.0)  # [BS, D]
            v = tl.load(V_CACHE + where, mask=valid[:, None], other=0.0)
            last = (positions == length - 1)[:, None]
            k = tl.where(last, k_new[None, :].to(k.dtype), k)
            v = tl.where(last, v_new[None, :].to(v.dtype), v)
            scores = tl.dot(q, tl.trans(k)).to(tl.float32) * scale  # [BLOCK_G, BS]
            scores = tl.where(valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a split with no key yet
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(scores - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
            m_i = m_new
        g_ok = offs_g < G
        tl.store(ACC + b * stride_ab + heads[:, None] * stride_ah + s * stride_as + offs_d[None, :], acc,
                 mask=g_ok[:, None])
        tl.store(M + b * stride_mb + heads * stride_mh + s, m_i, mask=g_ok)
        tl.store(L + b * stride_mb + heads * stride_mh + s, l_i, mask=g_ok)

    @triton.jit
    def _combine(ACC, M, L, OUT, stride_ab, stride_ah, stride_as, stride_mb, stride_mh, stride_ob, stride_oh,
                 SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, D: tl.constexpr):
        b = tl.program_id(0)
        hq = tl.program_id(1)
        offs_s = tl.arange(0, SPLITS_P2)
        offs_d = tl.arange(0, D)
        ok = offs_s < SPLITS
        m = tl.load(M + b * stride_mb + hq * stride_mh + offs_s, mask=ok, other=float("-inf"))
        l = tl.load(L + b * stride_mb + hq * stride_mh + offs_s, mask=ok, other=0.0)
        top = tl.max(m, 0)
        weight = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))
        acc = tl.load(ACC + b * stride_ab + hq * stride_ah + offs_s[:, None] * stride_as + offs_d[None, :],
                      mask=ok[:, None], other=0.0)  # [SPLITS_P2, D]
        out = tl.sum(acc * weight[:, None], 0) / tl.sum(l * weight, 0)
        tl.store(OUT + b * stride_ob + hq * stride_oh + offs_d, out.to(OUT.dtype.element_ty))


def paged_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_k: torch.Tensor,
                           cache_v: torch.Tensor, block_tables: torch.Tensor, positions: torch.Tensor,
                           write_index: torch.Tensor, write_source: torch.Tensor, key_length: int,
                           store: bool = True) -> torch.Tensor:
    """Store k, v [B, Hkv, D] at ``write_index`` of the pool cache_k, cache_v [N, block_size, Hkv, D]
    (row b taking row ``write_source[b]``'s; ``store`` False: already stored) and attend q [B, H, D]
    of each row to its first ``positions[b] + 1`` keys through ``block_tables`` [B, nb] → [B, H, D].
    ``key_length``: the keys the tables cover (a multiple of block_size at most nb x block_size)."""
    B, H, D = q.shape
    hkv, block_size = cache_k.shape[2], cache_k.shape[1]
    # positions, write_index and write_source may be columns of one packed index tensor: one stride.
    assert positions.stride(0) == write_index.stride(0) == write_source.stride(0), "index columns of one stride"
    group = H // hkv
    blocks = min(block_tables.shape[1], -(-key_length // block_size))
    per_split = split_blocks(B, hkv, blocks, q.device)
    splits = -(-blocks // per_split)
    q, k, v = q.contiguous(), k.contiguous().to(cache_k.dtype), v.contiguous().to(cache_v.dtype)
    acc = torch.empty(B, H, splits, D, dtype=torch.float32, device=q.device)
    m = torch.empty(B, H, splits, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    _partial[(B, hkv, splits)](
        q, k, v, cache_k, cache_v, block_tables, positions, write_index, write_source, acc, m, l, D ** -0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cache_k.stride(0), cache_k.stride(1), cache_k.stride(2),
        block_tables.stride(0), positions.stride(0), acc.stride(0), acc.stride(1), acc.stride(2), m.stride(0),
        m.stride(1), G=group, BLOCK_G=max(16, triton.next_power_of_2(group)), D=D, BS=block_size,
        BLOCKS_PER_SPLIT=per_split, STORE=store)
    out = torch.empty_like(q)
    _combine[(B, H)](acc, m, l, out, acc.stride(0), acc.stride(1), acc.stride(2), m.stride(0), m.stride(1),
                     out.stride(0), out.stride(1), SPLITS=splits, SPLITS_P2=triton.next_power_of_2(splits), D=D)
    return out

