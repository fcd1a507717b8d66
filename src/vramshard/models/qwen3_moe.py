"""Qwen3-MoE (e.g. Qwen3-30B-A3B): Qwen3 attention, routed experts in ``mlp.experts.E``."""

import torch

from ..config import ModelArgs, MoEArgs
from ..errors import ModelLoadError
from ..layers.moe import QWEN_EXPERTS
from .base import Model
from .decoder import decoder_model

ARCHITECTURES = ("Qwen3MoeForCausalLM",)


def model_args(config: dict) -> ModelArgs:
    try:
        moe = MoEArgs(
            num_experts=int(config.get("num_experts") or config["num_local_experts"]),
            top_k=int(config["num_experts_per_tok"]),
            intermediate_size=int(config["moe_intermediate_size"]),
            norm_topk_prob=bool(config.get("norm_topk_prob", False)),
            sparse_step=int(config.get("decoder_sparse_step", 1) or 1),
            dense_layers=tuple(int(i) for i in config.get("mlp_only_layers") or ()),
        )
    except KeyError as exc:
        raise ModelLoadError(f"config.json of a Qwen3-MoE model lacks {exc.args[0]!r}") from None
    return ModelArgs.from_config(config, qk_norm=True, moe=moe)


def build(args: ModelArgs, dtype: torch.dtype) -> Model:
    return decoder_model(args, dtype, QWEN_EXPERTS)
