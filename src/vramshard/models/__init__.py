"""Architecture registry: config.json ``architectures[0]`` → the module that builds it.

Each module has ``ARCHITECTURES`` (the HF class names it serves), ``model_args(config)``
and ``build(args, dtype) -> Model``.
"""

from __future__ import annotations

from types import ModuleType

import torch

from ..config import ModelArgs
from ..errors import UnsupportedArchitectureError
from . import llama, mistral, mixtral, olmoe, qwen2, qwen2_5_vl, qwen2_moe, qwen3, qwen3_moe
from .base import Model

_MODULES: tuple[ModuleType, ...] = (llama, mistral, qwen2, qwen3, qwen3_moe, qwen2_moe, mixtral, olmoe, qwen2_5_vl)
ARCHITECTURES: dict[str, ModuleType] = {name: m for m in _MODULES for name in m.ARCHITECTURES}


def architecture_module(config: dict) -> ModuleType:
    names = config.get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    shown = ", ".join(names) if names else f"model_type {config.get('model_type')!r}"
    raise UnsupportedArchitectureError(
        f"unsupported architecture {shown}; supported: {', '.join(sorted(ARCHITECTURES))}"
    )


def model_args(config: dict) -> ModelArgs:
    return architecture_module(config).model_args(config)


def build_model(config: dict, dtype: torch.dtype | None = None) -> Model:
    """The sub-layer list for a config.json dict, weights in ``dtype`` (default: the checkpoint's)."""
    module = architecture_module(config)
    args = module.model_args(config)
    model = module.build(args, dtype or args.dtype)
    model.config = config
    return model


__all__ = ["ARCHITECTURES", "Model", "build_model", "model_args", "architecture_module"]
