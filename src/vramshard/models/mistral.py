"""Mistral, Mistral-NeMo and Minitron: Llama layout with an explicit ``head_dim``.

Mistral-NeMo / Minitron set ``head_dim`` (128) different from hidden / heads; the base
reader already honours an explicit head_dim. Sliding-window attention is not applied:
for contexts within ``sliding_window`` (the case for NeMo, which has none) it is exact.
"""

import logging

from ..config import ModelArgs
from .decoder import decoder_model

ARCHITECTURES = ("MistralForCausalLM",)
log = logging.getLogger(__name__)


def model_args(config: dict) -> ModelArgs:
    args = ModelArgs.from_config(config)
    window = config.get("sliding_window")
    if window:
        log.info("sliding_window=%s: context limited to the window, inside which attention is exact", window)
        args = args.replace(max_position_embeddings=min(args.max_position_embeddings, int(window)))
    return args


build = decoder_model
