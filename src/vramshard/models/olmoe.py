"""OLMoE (e.g. OLMoE-1B-7B): Llama attention with RMSNorm over the whole q and k projections (and
an optional clamp of q, k, v), routed experts in ``mlp.experts.E`` of ``intermediate_size``."""

import torch

from ..config import ModelArgs, MoEArgs
from ..errors import ModelLoadError
from ..layers.moe import QWEN_EXPERTS
from .base import Model
from .decoder import decoder_model

ARCHITECTURES = ("OlmoeForCausalLM",)


def model_args(config: dict) -> ModelArgs:
    try:
        moe = MoEArgs(
            num_experts=int(config["num_experts"]),
            top_k=int(config["num_experts_per_tok"]),
            intermediate_size=int(config["intermediate_size"]),
            norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        )
    except KeyError as exc:
        raise ModelLoadError(f"config.json of an OLMoE model lacks {exc.args[0]!r}") from None
    clip = config.get("clip_qkv")
    return ModelArgs.from_config(config, qk_norm=True, qk_norm_per_head=False, moe=moe,
                                 clip_qkv=None if clip is None else float(clip))


def build(args: ModelArgs, dtype: torch.dtype) -> Model:
    return decoder_model(args, dtype, QWEN_EXPERTS)
