"""``attn[i]``: pre-norm, QKV projections, rotary, attention over the KV cache, output, residual."""

from __future__ import annotations

import os
from typing import Mapping

import torch
import torch.nn.functional as F

from ..config import ModelArgs
from . import cpu_gemv
from .norm import rms_norm
from .rotary import apply_rotary, cos_sin, inverse_frequencies, mrope_cos_sin
from .step import Step
from .sublayer import Cost, SubLayer, WeightSpec, linear


class Attention(SubLayer):
    """Grouped-query self-attention block (Llama / Mistral / Qwen2 / Qwen3 / OLMoE family)."""

    kind = "attn"
    fusable = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "qkv_bias": ("q_bias", "k_bias", "v_bias")}

    def __init__(self, args: ModelArgs, layer: int, prefix: str, dtype: torch.dtype):
        self.args = args
        self.num_heads = args.num_attention_heads
        self.num_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.eps = args.rms_norm_eps
        self.inv_freq = inverse_frequencies(args.rope, args.head_dim)
        # Multimodal rotary sections (Qwen2-VL family); only their args carry the field.
        self.mrope_section = tuple(getattr(args, "mrope_section", ()) or ())
        # Layers with the same rotary share one step's cos/sin tables (a per-layer key rebuilt
        # them in every layer: eight small ops each, 40 times per step on nemo-8b).
        self.rotary_key = (args.rope, self.head_dim, self.mrope_section)
        d, hq, hkv = args.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        specs = [
            WeightSpec("input_layernorm", f"{prefix}.input_layernorm.weight", (d,), dtype),
            WeightSpec("q_proj", f"{prefix}.self_attn.q_proj.weight", (hq, d), dtype),
            WeightSpec("k_proj", f"{prefix}.self_attn.k_proj.weight", (hkv, d), dtype),
            WeightSpec("v_proj", f"{prefix}.self_attn.v_proj.weight", (hkv, d), dtype),
            WeightSpec("o_proj", f"{prefix}.self_attn.o_proj.weight", (d, hq), dtype),
        ]
        if args.attention_bias:
            specs += [
                WeightSpec("q_bias", f"{prefix}.self_attn.q_proj.bias", (hq,), dtype),
                WeightSpec("k_bias", f"{prefix}.self_attn.k_proj.bias", (hkv,), dtype),
                WeightSpec("v_bias", f"{prefix}.self_attn.v_proj.bias", (hkv,), dtype),
            ]
        # q/k norm over each head (Qwen3) or over the whole projection (OLMoE), and a clamp of q, k, v.
        self.norm_per_head, self.clip = args.qk_norm_per_head, args.clip_qkv
        if args.qk_norm:
            q_width, k_width = (self.head_dim, self.head_dim) if self.norm_per_head else (hq, hkv)
            specs += [
                WeightSpec("q_norm", f"{prefix}.self_attn.q_norm.weight", (q_width,), dtype),
                WeightSpec("k_norm", f"{prefix}.self_attn.k_norm.weight", (k_width,), dtype),
            ]
        super().__init__(f"attn[{layer}]", layer, specs)

    launches = 22

    def matmuls(self, n_tokens: int) -> list[tuple[float, int, int]]:
        d = self.args.hidden_size
        hq, hkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return [(n_tokens, d, hq + 2 * hkv), (n_tokens, hq, d)]

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_kv_heads * self.head_dim * dtype.itemsize

    def cost(self, n_tokens: int, context: int) -> Cost:
        d = self.args.hidden_size
        hq, hkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        proj = 2 * n_tokens * d * (2 * hq + 2 * hkv)
        # Scores and weighted values: each new token attends to about `context` keys.
        attn = 2 * 2 * n_tokens * context * hq
        dtype = self.weights[0].dtype
        return Cost(
            flops=proj + attn,
            weight_bytes=self.nbytes,
            kv_bytes=context * self.kv_bytes_per_token(dtype),
            act_bytes=2 * n_tokens * d * dtype.itemsize,
        )

    def forward(self, w: Mapping[str, torch.Tensor], x: torch.Tensor, step: Step) -> torch.Tensor:
        cos, sin = step.memo(("rope", self.rotary_key, x.dtype), x.device,
                             lambda: self._rotary_tables(step.rotary_positions(x.device), x.dtype))
        q, k, v = self.qkv(w, x, cos, sin)
        out = attend(q, k, v, step.kv(self.layer), step)  # [T, H, D]
        return x + linear(out.reshape(x.shape[0], -1), w["o_proj"])

    def qkv(self, w: Mapping[str, torch.Tensor], x: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries [T, H, D], keys and values [T, Hkv, D] of x [T, hidden]: norm, projections,
        q/k norm where the model has it, rotary with the tables cos, sin [T, D]."""
        T = x.shape[0]
        h = rms_norm(x, w["input_layernorm"], self.eps)
        if "qkv_proj" in w and ("q_bias" not in w or "qkv_bias" in w):
            hq, hkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            qkv = linear(h, w["qkv_proj"], w.get("qkv_bias"))  # [T, hq + 2 hkv]
            if "q_norm" not in w:  # q and k lie side by side: one rotary for both (half the kernels)
                if self.clip is not None:
                    qkv = qkv.clamp(-self.clip, self.clip)
                qk = apply_rotary(qkv[:, : hq + hkv].view(T, self.num_heads + self.num_kv_heads, self.head_dim),
                                  cos, sin)
                q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
                return q, k, qkv[:, hq + hkv :].view(T, self.num_kv_heads, self.head_dim)
            q, k, v = qkv.split([hq, hkv, hkv], dim=-1)
        else:
            q = linear(h, w["q_proj"], w.get("q_bias"))
            k = linear(h, w["k_proj"], w.get("k_bias"))
            v = linear(h, w["v_proj"], w.get("v_bias"))
        if "q_norm" in w and not self.norm_per_head:  # over the whole projection [T, hq] / [T, hkv]
            q = rms_norm(q, w["q_norm"], self.eps)
            k = rms_norm(k, w["k_norm"], self.eps)
        if self.clip is not None:  # after a projection norm, as transformers' OLMoE
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if "q_norm" in w and self.norm_per_head:
            q = rms_norm(q, w["q_norm"], self.eps)
            k = rms_norm(k, w["k_norm"], self.eps)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def _rotary_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] for positions [T] (ordinary rotary) or [3, T] (multimodal rotary)."""
        if positions.dim() == 1:
            return cos_sin(self.inv_freq, positions, dtype)
        if not self.mrope_section:
            raise ValueError(f"{self.name}: 3-row rotary positions need a model with mrope_section")
        return mrope_cos_sin(self.inv_freq, positions, self.mrope_section, dtype)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache, step: Step) -> torch.Tensor:
    """Store k, v [T, Hkv, D] in the paged cache, then attend q [T, H, D] to each sequence's keys.

    Positions map to cache blocks through ``step.block_tables`` (or, without tables, the
    cache's fixed row per slot). One sequence whose blocks are consecutive attends over a
    view of the pool (no copy); otherwise its blocks are gathered. Several sequences are
    gathered and padded to a common query and key length, with a mask for causality and padding.
    """
    device = q.device
    flat_k = cache.k.view(-1, *cache.k.shape[2:])  # [num_blocks * block_size, Hkv, D]
    flat_v = cache.v.view(-1, *cache.v.shape[2:])
    k, v = k.to(flat_k.dtype), v.to(flat_v.dtype)
    geometry = (cache.block_size, cache.blocks_per_slot)
    scale = q.shape[-1] ** -0.5
    gqa = q.shape[1] != k.shape[1]

    if step.num_seqs == 1:
        start, n = step.starts[0], step.lengths[0]
        base = step.memo(("kv_base", geometry), None, lambda: _contiguous_base(step, cache))
        if base is not None:  # consecutive blocks: plain slices of the pool
            flat_k[base + start : base + start + n] = k
            flat_v[base + start : base + start + n] = v
            keys = flat_k[base : base + start + n].transpose(0, 1)[None]  # [1, Hkv, L, D]
            values = flat_v[base : base + start + n].transpose(0, 1)[None]
        else:
            index = step.memo(("kv_write", geometry), device, lambda: _write_index(step, cache, device))
            flat_k[index] = k
            flat_v[index] = v
            blocks = step.memo(("kv_blocks", geometry), device, lambda: _table_tensor(step, cache, device))[0]
            keys = cache.k[blocks].flatten(0, 1)[: start + n].transpose(0, 1)[None]  # [1, Hkv, L, D]
            values = cache.v[blocks].flatten(0, 1)[: start + n].transpose(0, 1)[None]
        if n == 1:  # decode: every key is visible, and the query heads of a KV head are its rows
            return decode_attention(q, keys, values, scale)
        query = q.transpose(0, 1)[None]  # [1, H, T, D]
        mask = None
        causal = False
        if n > 1:
            if start == 0:
                causal = True
            else:
                mask = _chunk_bias(start, n, device)
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, is_causal=causal,
                                             scale=scale, enable_gqa=gqa)
        return out[0].transpose(0, 1)  # [T, H, D]

    index = step.memo(("kv_write", geometry), device, lambda: _write_index(step, cache, device))
    flat_k[index] = k
    flat_v[index] = v
    B, q_max, k_max = step.num_seqs, max(step.lengths), step.max_context
    if q_max == 1 and device.type == "cpu":
        out = _decode_each(q, cache, step, scale)
        if out is not None:
            return out
    tables = step.memo(("kv_blocks", geometry), device, lambda: _table_tensor(step, cache, device))  # [B, nb]
    keys = cache.k[tables].flatten(1, 2)[:, :k_max].transpose(1, 2)  # [B, Hkv, L, D]
    values = cache.v[tables].flatten(1, 2)[:, :k_max].transpose(1, 2)
    mask = step.memo("batch_mask", device, lambda: _batch_mask(step, q_max, k_max, device))  # [B, 1, Qmax, L]
    if q_max == 1:
        return decode_attention(q, keys, values, scale, mask)
    rows, cols = step.memo("pad_index", device, lambda: _pad_index(step, device))
    query = q.new_zeros(B, q_max, q.shape[1], q.shape[2])
    query[rows, cols] = q
    out = F.scaled_dot_product_attention(query.transpose(1, 2), keys, values, attn_mask=mask,
                                         scale=scale, enable_gqa=gqa)  # [B, H, Qmax, D]
    return out.transpose(1, 2)[rows, cols]


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
    """One new token per sequence: q [B, H, D] against keys, values [B, Hkv, L, D] → [B, H, D].

    The G = H / Hkv query heads sharing a KV head become G query rows of that head (head h reads
    KV head h // G, as a GQA broadcast does), so no kernel needs GQA support: a masked SDPA call
    with a GQA broadcast would take the slow math kernel and materialise repeated keys and values.
    mask: [B, 1, 1, L] (padding of a batch), or None when every key is visible. One sequence on the CPU
    in half precision goes through the C kernel (:func:`.cpu_gemv.decode_attention`): SDPA read the
    cache's rows at 7.2-7.3 GB/s on the development machine, the kernel at 10.9-12.1 (session 36).
    """
    B, H, D = q.shape
    if B == 1 and mask is None and q.device.type == "cpu" and cpu_gemv.serves_attention(q[0], keys[0], values[0]):
        return cpu_gemv.decode_attention(q[0], keys[0], values[0], scale)[None]  # each cached row read once
    kv_heads = keys.shape[1]
    grouped = q.view(B, kv_heads, H // kv_heads, D)  # [B, Hkv, G, D]
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(B, H, D)


def _decode_each(q: torch.Tensor, cache, step: Step, scale: float) -> torch.Tensor | None:
    """One new token of each of several sequences on the CPU, q [B, H, D] → [B, H, D], by the C kernel over each
    sequence's own rows of the pool rather than all gathered into one padded batch first: in one call where every
    sequence's blocks are consecutive (64 sequences at 1K context in bf16 on the 2-core development machine: 21.3
    ms against 143.0 padded, session 63), else sequence by sequence, a sequence whose blocks are
    not consecutive over a copy of them. None where the kernel does not serve these tensors (the caller takes the
    padded batch)."""
    flat_k = cache.k.view(-1, *cache.k.shape[2:])  # [num_blocks * block_size, Hkv, D]
    flat_v = cache.v.view(-1, *cache.v.shape[2:])
    if not cpu_gemv.serves_attention(q[0], flat_k[:1].transpose(0, 1), flat_v[:1].transpose(0, 1)):
        return None
    size = cache.block_size
    rows = step.memo(("kv_rows", size), None, lambda: _consecutive_rows(step, cache))
    if rows is not None:  # [2, B]: each sequence's first pool row and its length
        return cpu_gemv.decode_attention_rows(q.contiguous(), flat_k, flat_v, rows[0], rows[1], scale)
    out = []
    for b, (table, start) in enumerate(zip(_block_tables(step, cache), step.starts)):
        length = start + 1
        used = -(-length // size)
        first = table[0]
        if _consecutive(table, used):
            keys = flat_k[first * size : first * size + length].transpose(0, 1)  # [Hkv, L, D] (a view)
            values = flat_v[first * size : first * size + length].transpose(0, 1)
        else:
            blocks = torch.tensor(list(table[:used]), dtype=torch.long)
            keys = cache.k[blocks].flatten(0, 1)[:length].transpose(0, 1)
            values = cache.v[blocks].flatten(0, 1)[:length].transpose(0, 1)
        out.append(cpu_gemv.decode_attention(q[b], keys, values, scale))
    return torch.stack(out)


def _consecutive_rows(step: Step, cache) -> torch.Tensor | None:
    """[2, B] int64: each sequence's first pool row and its positions with the new one, where every sequence's
    blocks are consecutive; else None."""
    size = cache.block_size
    firsts, lengths = [], []
    for table, start in zip(_block_tables(step, cache), step.starts):
        if not _consecutive(table, -(-(start + 1) // size)):
            return None
        firsts.append(table[0] * size)
        lengths.append(start + 1)
    return torch.tensor([firsts, lengths], dtype=torch.long)


def _block_tables(step: Step, cache) -> list:
    """Each sequence's blocks in position order: the step's tables, or the cache's fixed rows."""
    if step.block_tables is not None:
        return step.block_tables
    per_slot = cache.blocks_per_slot
    return [range(slot * per_slot, (slot + 1) * per_slot) for slot in step.slots]


def _contiguous_base(step: Step, cache) -> int | None:
    """Flat pool row of position 0 of the step's only sequence when the blocks it uses are consecutive."""
    table = _block_tables(step, cache)[0]
    used = -(-step.max_context // cache.block_size)
    assert len(table) >= used, "a block table must cover the step's positions"
    return table[0] * cache.block_size if _consecutive(table, used) else None


def _consecutive(table, used: int) -> bool:
    """Whether the first ``used`` blocks of a block table follow one another in the pool."""
    first = table[0]
    return isinstance(table, range) or all(table[i] == first + i for i in range(1, used))


def _write_index(step: Step, cache, device) -> torch.Tensor:
    """Flat pool row of every new token [T] (int64)."""
    size = cache.block_size
    index = []
    for table, start, n in zip(_block_tables(step, cache), step.starts, step.lengths):
        assert len(table) * size >= start + n, "a block table must cover the step's positions"
        index += [table[p // size] * size + p % size for p in range(start, start + n)]
    return torch.tensor(index, dtype=torch.long).to(device, non_blocking=True)


def _table_tensor(step: Step, cache, device) -> torch.Tensor:
    """Blocks holding positions 0 .. max_context - 1 of each sequence [B, nb] (short tables padded
    with their first block; those keys lie beyond the sequence's length and are masked)."""
    used = -(-step.max_context // cache.block_size)
    rows = []
    for table in _block_tables(step, cache):
        row = list(table[:used])
        rows.append(row + [row[0]] * (used - len(row)))
    return torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)


# A prompt chunk after the first attends causally with its diagonal at the bottom right. As a
# boolean mask, SDPA runs it with GQA only in its math kernel, which holds [H, n, L] scores (and
# the VRAM they took grew chunk after chunk: docs/BENCHMARKS.md, fifth session); the lower-right
# causal bias runs in the flash kernel on CUDA. VRAMSHARD_CHUNK_ATTENTION=mask restores the mask.
CHUNK_ATTENTION = os.environ.get("VRAMSHARD_CHUNK_ATTENTION", "lower_right").lower()
FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256


def fused_prompt_attention(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether a one-sequence prompt chunk on the GPU attends in the flash kernel, which holds no
    score matrix and no per-head copy of the keys (the first chunk through ``is_causal``, later
    ones through the lower-right causal bias): a half-precision model, a head size flash takes,
    the bias not switched off, and a GPU of compute capability 8.0 or newer when one is present.
    Otherwise PyTorch may take its math kernel, whose temporaries the planner must count."""
    if CHUNK_ATTENTION == "mask" or dtype not in FLASH_DTYPES or head_dim > FLASH_MAX_HEAD_DIM:
        return False
    if torch.cuda.is_available():
        return torch.cuda.get_device_capability() >= (8, 0)
    return True


def _chunk_bias(start: int, n: int, device):
    """What a prompt chunk of ``n`` tokens after ``start`` cached ones may see: SDPA's ``attn_mask``."""
    if torch.device(device).type == "cuda" and CHUNK_ATTENTION != "mask":
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(n, start + n)
    return _chunk_mask(start, n, device)


def _chunk_mask(start: int, n: int, device) -> torch.Tensor:
    # New token j (absolute position start + j) sees keys 0 .. start + j.
    keys = torch.arange(start + n, device=device)
    queries = torch.arange(start, start + n, device=device)
    return keys[None, :] <= queries[:, None]  # [n, L]


def _pad_index(step: Step, device) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [b for b, n in enumerate(step.lengths) for _ in range(n)]
    cols = [j for n in step.lengths for j in range(n)]
    return torch.tensor(rows, device=device), torch.tensor(cols, device=device)


def _batch_mask(step: Step, q_max: int, k_max: int, device) -> torch.Tensor:
    starts = torch.tensor(step.starts, device=device)[:, None, None]  # [B, 1, 1]
    ends = starts + torch.tensor(step.lengths, device=device)[:, None, None]
    query_pos = starts + torch.arange(q_max, device=device)[None, :, None]  # [B, Qmax, 1]
    key_pos = torch.arange(k_max, device=device)[None, None, :]  # [1, 1, L]
    # Padded query rows (beyond a sequence's length) still see key 0, so no row is empty.
    mask = (key_pos <= query_pos) & (key_pos < ends)
    return mask[:, None]  # [B, 1, Qmax, L]
