"""The KV cache: per attention layer, one row of ``max_ctx`` positions per sequence slot."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class LayerCache:
    k: torch.Tensor  # [slots, max_ctx, kv_heads, head_dim]
    v: torch.Tensor  # [slots, max_ctx, kv_heads, head_dim]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class KVCache:
    """Caches for the given attention layers, each on the device ``device_of(layer)`` says."""

    def __init__(self, layers: list[int], slots: int, max_ctx: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device_of: Callable[[int], torch.device | str]):
        self.slots, self.max_ctx = slots, max_ctx
        shape = (slots, max_ctx, kv_heads, head_dim)
        self._layers = {
            layer: LayerCache(torch.zeros(shape, dtype=dtype, device=device_of(layer)),
                              torch.zeros(shape, dtype=dtype, device=device_of(layer)))
            for layer in layers
        }

    def __call__(self, layer: int) -> LayerCache:
        return self._layers[layer]

    def bytes_on(self, device_type: str) -> int:
        return sum(c.nbytes for c in self._layers.values() if c.k.device.type == device_type)

    @staticmethod
    def bytes_needed(num_layers: int, slots: int, max_ctx: int, kv_heads: int, head_dim: int,
                     dtype: torch.dtype) -> int:
        return 2 * num_layers * slots * max_ctx * kv_heads * head_dim * dtype.itemsize
