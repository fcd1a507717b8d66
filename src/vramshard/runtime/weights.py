"""Reading a model's weights out of a checkpoint, checked against the model's specs."""

from __future__ import annotations

import logging
from typing import Callable

import torch

from ..errors import ModelLoadError
from ..loading.checkpoint import Checkpoint
from ..models.base import Model

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]  # (tensors done, tensors total)


def check_checkpoint(model: Model, checkpoint: Checkpoint) -> None:
    """Every tensor the model needs is present with the right shape; say what is not."""
    specs = model.weight_specs()
    missing = [name for name in specs if name not in checkpoint.tensors]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"{checkpoint.path}: missing tensors {shown}")
    for name, spec in specs.items():
        shape = tuple(checkpoint.tensors[name].shape)
        if shape != spec.shape:
            raise ModelLoadError(
                f"{checkpoint.path}: tensor {name!r} has shape {list(shape)}, expected {list(spec.shape)} "
                "from config.json"
            )
    extra = [name for name in checkpoint.tensors if name not in specs]
    if extra:
        log.debug("ignoring %d checkpoint tensors the model does not use, e.g. %s", len(extra), extra[:3])


def load_weights(model: Model, checkpoint: Checkpoint, progress: Progress | None = None) -> dict[str, torch.Tensor]:
    """All weights as CPU tensors in the model's dtype, keyed by checkpoint name."""
    check_checkpoint(model, checkpoint)
    specs = model.weight_specs()
    weights = {}
    for done, (name, spec) in enumerate(specs.items(), 1):
        tensor = checkpoint.tensors.load(name)
        weights[name] = tensor.to(spec.dtype).contiguous()
        if progress:
            progress(done, len(specs))
    return weights
