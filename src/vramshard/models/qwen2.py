"""Qwen2 and Qwen2.5: Llama layout with bias on the q/k/v projections."""

from ..config import ModelArgs
from .decoder import decoder_model

ARCHITECTURES = ("Qwen2ForCausalLM",)


def model_args(config: dict) -> ModelArgs:
    return ModelArgs.from_config(config, attention_bias=True)


build = decoder_model
