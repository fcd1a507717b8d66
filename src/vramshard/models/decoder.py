"""Sub-layer lists shared by the decoder-only architectures.

The architecture files differ in how config.json maps to :class:`ModelArgs` and in
how experts are named; the list of sub-layers they produce is built here.
"""

from __future__ import annotations

import torch

from ..config import ModelArgs
from ..layers.attention import Attention
from ..layers.embedding import Embedding, Head
from ..layers.mlp import DenseFFN
from ..layers.moe import ExpertNames, MoEFFN
from .base import Model


def decoder_model(args: ModelArgs, dtype: torch.dtype, experts: ExpertNames | None = None) -> Model:
    """``embed, attn[0], ffn[0], ..., attn[L-1], ffn[L-1], head``."""
    sublayers = [Embedding(args, dtype)]
    for layer in range(args.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        sublayers.append(Attention(args, layer, prefix, dtype))
        if args.moe is not None and args.moe.is_moe_layer(layer):
            assert experts is not None, "an MoE architecture must say how its experts are named"
            sublayers.append(MoEFFN(args, layer, prefix, dtype, experts))
        else:
            sublayers.append(DenseFFN(args, layer, prefix, dtype))
    sublayers.append(Head(args, dtype))
    return Model(args, sublayers, dtype)
