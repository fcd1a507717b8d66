"""Qwen3: no q/k/v bias (unless configured), RMSNorm on each head of q and k."""

from ..config import ModelArgs
from .decoder import decoder_model

ARCHITECTURES = ("Qwen3ForCausalLM",)


def model_args(config: dict) -> ModelArgs:
    return ModelArgs.from_config(config, qk_norm=True)


build = decoder_model
