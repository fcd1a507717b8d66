"""A model: its hyper-parameters and its ordered list of sub-layers."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import ModelArgs
from ..layers.attention import Attention
from ..layers.sublayer import SubLayer, WeightSpec


@dataclass
class Model:
    """``embed``, ``attn[0]``, ``ffn[0]``, ..., ``head``: the units the planner places.

    Built from :class:`ModelArgs` alone (no weights), so a model of any size can be
    described, costed and planned before a byte of it is read.
    """

    args: ModelArgs
    sublayers: list[SubLayer]
    dtype: torch.dtype
    # The config.json dict it was built from (build_model), where there is one: a planning process
    # builds the model again from it (vramshard.runtime.plan_wire).
    config: dict | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        self._by_name = {s.name: s for s in self.sublayers}

    def __getitem__(self, name: str) -> SubLayer:
        return self._by_name[name]

    def __iter__(self):
        return iter(self.sublayers)

    def __len__(self) -> int:
        return len(self.sublayers)

    @property
    def attention_layers(self) -> list[Attention]:
        return [s for s in self.sublayers if isinstance(s, Attention)]

    def weight_specs(self) -> dict[str, WeightSpec]:
        """Every distinct checkpoint tensor the model needs, by source name."""
        specs: dict[str, WeightSpec] = {}
        for sublayer in self.sublayers:
            for spec in sublayer.weights:
                specs.setdefault(spec.source, spec)
        return specs

    @property
    def nbytes(self) -> int:
        """Bytes of all distinct weights (tied embeddings counted once)."""
        return sum(spec.nbytes for spec in self.weight_specs().values())

    def kv_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        """KV-cache bytes one token of context costs, over all layers."""
        dtype = dtype or self.dtype
        return sum(a.kv_bytes_per_token(dtype) for a in self.attention_layers)
