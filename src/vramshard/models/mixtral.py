"""Mixtral: Mistral attention, 8 routed experts (``block_sparse_moe.experts.E.w1/w2/w3``)."""

import torch

from ..config import ModelArgs, MoEArgs
from ..errors import ModelLoadError
from ..layers.moe import MIXTRAL_EXPERTS
from .base import Model
from .decoder import decoder_model

ARCHITECTURES = ("MixtralForCausalLM",)


def model_args(config: dict) -> ModelArgs:
    try:
        moe = MoEArgs(
            num_experts=int(config["num_local_experts"]),
            top_k=int(config["num_experts_per_tok"]),
            intermediate_size=int(config["intermediate_size"]),
            norm_topk_prob=True,
        )
    except KeyError as exc:
        raise ModelLoadError(f"config.json of a Mixtral model lacks {exc.args[0]!r}") from None
    return ModelArgs.from_config(config, moe=moe)


def build(args: ModelArgs, dtype: torch.dtype) -> Model:
    return decoder_model(args, dtype, MIXTRAL_EXPERTS)
