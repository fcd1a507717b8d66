"""Qwen2-MoE (e.g. Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2 attention (q/k/v bias), routed
experts in ``mlp.experts.E`` and a gated shared expert in ``mlp.shared_expert``."""

import torch

from ..config import ModelArgs, MoEArgs
from ..errors import ModelLoadError
from ..layers.moe import QWEN_EXPERTS
from .base import Model
from .decoder import decoder_model

ARCHITECTURES = ("Qwen2MoeForCausalLM",)


def model_args(config: dict) -> ModelArgs:
    try:
        moe = MoEArgs(
            num_experts=int(config["num_experts"]),
            top_k=int(config["num_experts_per_tok"]),
            intermediate_size=int(config["moe_intermediate_size"]),
            norm_topk_prob=bool(config.get("norm_topk_prob", False)),
            sparse_step=int(config.get("decoder_sparse_step", 1) or 1),
            dense_layers=tuple(int(i) for i in config.get("mlp_only_layers") or ()),
            shared_intermediate_size=int(config.get("shared_expert_intermediate_size") or 0),
            shared_gated=True,
        )
    except KeyError as exc:
        raise ModelLoadError(f"config.json of a Qwen2-MoE model lacks {exc.args[0]!r}") from None
    if config.get("use_sliding_window"):
        raise ModelLoadError("Qwen2-MoE with use_sliding_window=true is not supported (every layer attends fully)")
    return ModelArgs.from_config(config, attention_bias=bool(config.get("qkv_bias", True)), moe=moe)


def build(args: ModelArgs, dtype: torch.dtype) -> Model:
    return decoder_model(args, dtype, QWEN_EXPERTS)
