"""``attn[i]`` for a decode step in fixed shapes: the same function as :meth:`Attention.forward`
for one new token per row, with every index a tensor of a shape fixed by the step's bucket.

:func:`~vramshard.layers.attention.attend` builds its indices from Python lists and picks a
code path by the step's shape (a view of the pool for one contiguous sequence, a gather for
the rest). Here a step of B rows (sequences, padded up to a batch bucket) attending to at most
L keys (a key-length bucket) always gathers ``nb = ceil(L / block_size)`` blocks per row and
masks keys beyond each row's position, so nothing in the computation depends on the values of
the indices: no host synchronisation, no data-dependent shape. That is what a CUDA graph needs;
the math itself knows nothing of graphs or devices.

Padded rows (beyond the step's real sequences) must not disturb the cache: each padded row
writes the key and value *of row 0* to row 0's position (``write_source`` = 0, ``write_index``
= row 0's), so the duplicate writes carry identical values, and they see key 0 only.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.nn.functional as F

from . import paged_decode
from .attention import FLASH_DTYPES, FLASH_MAX_HEAD_DIM, Attention
from .step import LayerKV
from .sublayer import linear


@dataclass
class DecodeIndex:
    """The per-step inputs of a fixed-shape decode step of B rows over at most L keys.

    positions: [B] int64, position of each row's new token (padded rows: 0).
    write_index: [B] int64, flat pool row (block * block_size + offset) where each row's new key
    and value go (padded rows: row 0's).
    write_source: [B] int64, the row whose new key and value are written there (padded rows: 0).
    block_tables: [B, nb] int64, blocks holding positions 0 .. nb * block_size - 1 of each row
    (padded with any valid block; keys beyond a row's position are masked).
    mask: [B, 1, 1, L] bool, key j visible to row b iff j <= positions[b] (see :func:`decode_mask`).
    """

    positions: torch.Tensor
    write_index: torch.Tensor
    write_source: torch.Tensor
    block_tables: torch.Tensor
    mask: torch.Tensor

    @property
    def key_length(self) -> int:
        return self.mask.shape[-1]

    @functools.cached_property
    def flash_lengths(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:func:`flash_lengths` of this step, made once and shared by every layer (in a graph
        step, four small kernels a step instead of four a layer)."""
        return flash_lengths(self.positions, self.key_length)


def decode_mask(positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """[B, 1, 1, L] bool: key j (``key_positions`` [L] = 0 .. L-1) is visible to row b iff j <= positions[b]."""
    return (key_positions[None, :] <= positions[:, None])[:, None, None, :]


def static_attention(attn: Attention, w: Mapping[str, torch.Tensor], x: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, cache: LayerKV, index: DecodeIndex) -> torch.Tensor:
    """:meth:`Attention.forward` for x [B, D] (one new token per row) in fixed shapes.

    cos, sin: rotary tables [B, head_dim] of ``index.positions``.
    """
    q, k, v = attn.qkv(w, x, cos, sin)
    out = static_attend(q, k, v, cache, index)  # [B, H, D]
    return attention_output(x, out, w["o_proj"])


def attention_output(x: torch.Tensor, out: torch.Tensor, o_proj: torch.Tensor) -> torch.Tensor:
    """The residual stream after attention: x [B, D] + o_proj(out [B, H, D])."""
    return x + linear(out.reshape(x.shape[0], -1), o_proj)


def static_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKV,
                  index: DecodeIndex) -> torch.Tensor:
    """Store k, v [B, Hkv, D] in the paged cache, then attend q [B, H, D] to each row's keys → [B, H, D]."""
    if _takes_paged() and paged_decode.available(q, cache.block_size):
        return paged_decode.paged_decode_attention(q, k, v, cache.k, cache.v, index.block_tables, index.positions,
                                                   index.write_index, index.write_source, index.key_length)
    store_kv(k, v, cache.k, cache.v, index.write_index, index.write_source)
    return attend_cached(q, cache, index)


def store_kv(k: torch.Tensor, v: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
             write_index: torch.Tensor, write_source: torch.Tensor) -> None:
    """Write the new keys and values k, v [B, Hkv, D] into the paged pool cache_k, cache_v
    [num_blocks, block_size, Hkv, D] at the flat rows ``write_index`` [B], row b taking row
    ``write_source[b]``'s (see :class:`DecodeIndex`)."""
    flat_k = cache_k.view(-1, *cache_k.shape[2:])  # [num_blocks * block_size, Hkv, D]
    flat_v = cache_v.view(-1, *cache_v.shape[2:])
    # Padded rows write row 0's values to row 0's place: duplicates agree, whichever lands last.
    # A one-row step has no padded row (its source is itself): two kernels a layer fewer.
    k, v = k.to(flat_k.dtype), v.to(flat_v.dtype)
    if k.shape[0] > 1:
        k, v = k.index_select(0, write_source), v.index_select(0, write_source)
    flat_k.index_copy_(0, write_index, k)
    flat_v.index_copy_(0, write_index, v)


def attend_cached(q: torch.Tensor, cache: LayerKV, index: DecodeIndex) -> torch.Tensor:
    """Attend q [B, H, D] to each row's keys in the paged cache (its new key stored) → [B, H, D]."""
    B, nb = index.block_tables.shape
    L = index.key_length
    hkv = cache.k.shape[2]
    blocks = index.block_tables.reshape(-1)  # [B * nb]
    keys = cache.k.index_select(0, blocks).view(B, -1, *cache.k.shape[2:])[:, :L].transpose(1, 2)  # [B, Hkv, L, D]
    values = cache.v.index_select(0, blocks).view(B, -1, *cache.v.shape[2:])[:, :L].transpose(1, 2)
    # One query per row: the G = H / Hkv query heads sharing a KV head become G query rows of that
    # head (head h reads KV head h // G, as repeat_interleave). No GQA broadcast is needed, which SDPA
    # would only give a masked call through its slow math kernel.
    group = q.shape[1] // hkv
    scale = q.shape[-1] ** -0.5
    if _takes_flash(B) and q.is_cuda and flash_runs(q.dtype, q.shape[-1], q.device):
        return flash_varlen_attention(q, keys.transpose(1, 2), values.transpose(1, 2), index.flash_lengths, scale)
    query = q.view(B, hkv, group, q.shape[-1])  # [B, Hkv, G, D]
    if DECODE_ATTENTION == "matmul":
        out = matmul_attention(query, keys, values, index.mask, scale)
    else:
        out = masked_attention(query, keys, values, index.mask, scale)
    return out.reshape(B, q.shape[1], q.shape[-1])  # [B, H, D]


# The kernel of a fixed-shape decode step's attention (VRAMSHARD_DECODE_ATTENTION):
#   auto          (default) paged where it runs (Triton on a GPU, half precision, see
#                 paged_decode.available); elsewhere flash-varlen for steps of at most
#                 FLASH_MAX_ROWS rows, sdpa above.
#   paged         the Triton kernel of :mod:`~vramshard.layers.paged_decode`: the new key and value
#                 stored and every row's blocks read in place through its block table (no gather),
#                 split over the keys; elsewhere as auto.
#                 benchmarks/decode_attention.py on the H200 (eighth session, nemo-8b's heads,
#                 µs a layer in a graph, 1088 / 4160 keys): 1 row flash 15.6 / 22.8 against sdpa
#                 32.9 / 92.4; 16 rows 43.1 / 89.1 against 37.9 / 100.2; 64 rows 133.5 / 468.7
#                 against 112.5 / 384.9. nemo-8b's one-row graph step: 7.82 ms against 10.19.
#   flash-varlen  the flash kernel over the padded keys, each row reading its first
#                 ``position + 1`` of them (``seqused_k``): no mask. Where it runs
#                 (:func:`flash_runs`: half precision, head size, GPUs of sm80 on); other
#                 steps take ``sdpa``.
#   sdpa          SDPA with a boolean mask. It takes the memory-efficient kernel, which tiles
#                 queries (here G rows) and does not split the keys.
#   matmul        the reference's eager attention: scores in the compute dtype, softmax in float32.
DECODE_KERNELS = ("auto", "paged", "flash-varlen", "sdpa", "matmul")
DECODE_ATTENTION = os.environ.get("VRAMSHARD_DECODE_ATTENTION", "auto").lower()
if DECODE_ATTENTION not in DECODE_KERNELS:
    raise ValueError(f"VRAMSHARD_DECODE_ATTENTION must be one of {', '.join(DECODE_KERNELS)}, "
                     f"got {DECODE_ATTENTION!r}")
FLASH_MAX_ROWS = 16


def flash_runs(dtype: torch.dtype, head_dim: int, device: torch.device) -> bool:
    """Whether the flash kernel takes this decode attention: half precision, a head size it
    supports, and a GPU of compute capability 8.0 or newer (older ones take ``sdpa``)."""
    return dtype in FLASH_DTYPES and head_dim <= FLASH_MAX_HEAD_DIM and head_dim % 8 == 0 \
        and _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (8, 0)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _takes_paged() -> bool:
    """Whether decode steps attend with the Triton paged kernel (where it runs)."""
    return DECODE_ATTENTION in ("auto", "paged")


def _takes_flash(rows: int) -> bool:
    """Whether a step of ``rows`` sequences attends with flash-varlen (where the kernel applies)."""
    return DECODE_ATTENTION == "flash-varlen" or (DECODE_ATTENTION in ("auto", "paged") and rows <= FLASH_MAX_ROWS)


def masked_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """query [B, Hkv, G, D] over keys, values [B, Hkv, L, D], mask [B, 1, 1, L] bool → [B, Hkv, G, D]."""
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale)


def matmul_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """:func:`masked_attention` as the reference's eager attention computes it: the scores
    [B, Hkv, G, L] in the compute dtype, their softmax in float32."""
    scores = torch.matmul(query, keys.transpose(-1, -2)).float() * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1).to(values.dtype), values)


def flash_lengths(positions: torch.Tensor, key_length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cu_seqlens_q [B+1], cu_seqlens_k [B+1], seqused_k [B]), int32, of one query per row over
    ``key_length`` padded keys of which row b reads the first ``positions[b] + 1``."""
    rows = torch.arange(positions.shape[0] + 1, device=positions.device, dtype=torch.int32)
    return rows, rows * key_length, (positions + 1).to(torch.int32)


def flash_varlen_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                           lengths: tuple[torch.Tensor, torch.Tensor, torch.Tensor], scale: float) -> torch.Tensor:
    """One query per row, q [B, H, D], over keys, values [B, L, Hkv, D] as ``lengths``
    (:func:`flash_lengths`) say → [B, H, D]. The flash kernel's variable-length form (CUDA only)."""
    B, L = keys.shape[:2]
    cu_q, cu_k, used_k = lengths
    out = torch.ops.aten._flash_attention_forward(
        q, keys.reshape(B * L, *keys.shape[2:]), values.reshape(B * L, *values.shape[2:]),
        cu_q, cu_k, 1, L, 0.0, False, False, scale=scale, seqused_k=used_k)
    return out[0]
