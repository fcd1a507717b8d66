"""Llama (1, 2, 3, 3.1 with rope scaling): the reference decoder."""

from ..config import ModelArgs
from .decoder import decoder_model

ARCHITECTURES = ("LlamaForCausalLM",)


def model_args(config: dict) -> ModelArgs:
    return ModelArgs.from_config(config)


build = decoder_model
