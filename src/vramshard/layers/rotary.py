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
