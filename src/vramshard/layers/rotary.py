"""Rotary position embedding (RoPE), with linear and Llama 3 frequency scaling."""

from __future__ import annotations

import math

import torch

from ..config import RopeArgs


def inverse_frequencies(rope: RopeArgs, head_dim: int) -> torch.Tensor:
    """Per-pair inverse frequencies [head_dim / 2] in float32."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponent)
    if rope.type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.type == "llama3":
        inv_freq = _llama3_scale(inv_freq, rope)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeArgs) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
    high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    in_band = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(in_band, blended, scaled)


def cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [T, head_dim] for token positions [T]."""
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]  # [T, head_dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by position; cos/sin [T, D] (the half-split layout of HF checkpoints)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


ROTARY_ROWS = 4096  # rows of apply_rotary_float32's float32 temporaries


def apply_rotary_float32(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         rows: int = ROTARY_ROWS) -> torch.Tensor:
    """``apply_rotary`` computed in float32 and returned in ``x``'s dtype, ``rows`` rows at a time.

    The same numbers as ``apply_rotary(x.float(), cos, sin).to(x.dtype)`` (the rotation is per
    row), but the float32 temporaries are [rows, H, D] instead of [T, H, D]: for a 1440p image
    (18,564 patches) the whole-tensor form holds about 0.5 GB of them at once.
    """
    out = torch.empty_like(x)
    for begin in range(0, x.shape[0], rows):
        end = begin + rows
        out[begin:end] = apply_rotary(x[begin:end].float(), cos[begin:end], sin[begin:end])
    return out


def mrope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, section: tuple[int, ...],
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Multimodal rotary (Qwen2-VL "mrope"): cos and sin [T, head_dim] for positions [3, T].

    Rows are the temporal, height and width positions; frequency pair j takes its angle
    from row ``i % 3`` where ``i`` is the section of ``section`` (sums to head_dim / 2)
    that j falls in. With three equal rows this is ordinary rotary.
    """
    freqs = positions.float()[:, :, None] * inv_freq.to(positions.device)[None, None, :]  # [3, T, head_dim/2]
    chunks = freqs.split(list(section), dim=-1)
    freqs = torch.cat([chunk[i % 3] for i, chunk in enumerate(chunks)], dim=-1)  # [T, head_dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def axial_inverse_frequencies(theta: float, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim / 4] of the 2-D (row, column) rotary of Qwen2-VL vision encoders."""
    spatial = head_dim // 2
    return 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))


def axial_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 cos and sin [N, head_dim] for (row, column) patch positions [N, 2].

    The first quarter of the pairs rotate with the row, the second with the column; the
    half-split layout repeats them for the second half, as ``apply_rotary`` expects.
    """
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)  # [N, 2, head_dim/4]
    freqs = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)  # [N, head_dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()
