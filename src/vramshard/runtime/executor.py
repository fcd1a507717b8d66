"""Runs the sub-layers of a model for one step.

This first executor keeps every sub-layer on one device. Placements over CPU and GPU
with streamed weights build on the same loop (see the Executor issue).
"""

from __future__ import annotations

import torch

from ..layers.step import Step
from ..models.base import Model


class Executor:
    """All weights and all compute on ``device``."""

    def __init__(self, model: Model, weights: dict[str, torch.Tensor], device: torch.device | str):
        self.model = model
        self.device = torch.device(device)
        on_device = {name: t.to(self.device) for name, t in weights.items()}
        # sublayer name -> {WeightSpec.key: tensor}
        self.sublayer_weights = {
            s.name: {spec.key: on_device[spec.source] for spec in s.weights} for s in model
        }

    def kv_device(self, layer: int) -> torch.device:
        return self.device

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, step: Step) -> torch.Tensor:
        """token ids [T] → float32 logits [R, V] for the step's logit rows, on the CPU."""
        x = token_ids.to(self.device)
        for sublayer in self.model:
            x = sublayer.forward(self.sublayer_weights[sublayer.name], x, step)
        return x.cpu()
