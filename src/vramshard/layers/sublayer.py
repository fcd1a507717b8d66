"""The unit of placement: a sub-layer with its weights, its cost and one forward.

A sub-layer is pure math. It never moves tensors between devices, never sees a
stream or a budget: ``forward`` receives its weights (wherever the executor put
them), the activations and a :class:`~vramshard.layers.step.Step`, and computes on
the device its inputs live on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from .step import Step
from .cpu_linear import cpu_linear

MAIN_PIECE = "main"


@dataclass(frozen=True)
class WeightSpec:
    """One weight tensor of a sub-layer.

    ``key`` is the name ``forward`` uses; ``source`` the checkpoint (Hugging Face) name.
    ``piece`` groups weights that are placed together: ``"main"`` for most, ``"expert.E"``
    for one routed expert of a MoE FFN, so experts can be streamed and cached one by one.
    """

    key: str
    source: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    piece: str = MAIN_PIECE

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


@dataclass(frozen=True)
class Cost:
    """Work of one sub-layer for one step: arithmetic and bytes it must read."""

    flops: float  # floating-point operations (multiply-add = 2)
    weight_bytes: float  # weight bytes touched (MoE: only the routed experts, expected value)
    kv_bytes: float = 0.0  # KV-cache bytes read
    act_bytes: float = 0.0  # activation bytes in + out


class SubLayer:
    """Base class: ``embed``, ``attn[i]``, ``ffn[i]``, ``head`` (and vision sub-layers later)."""

    kind: str = "?"
    # Weights that may be given to ``forward`` as one fused tensor, e.g. {"qkv_proj": ("q_proj",
    # "k_proj", "v_proj")}: where they lie back to back in one buffer, the fused view is free
    # and saves kernel launches; ``forward`` must work with and without it.
    fusable: dict[str, tuple[str, ...]] = {}

    def __init__(self, name: str, layer: int | None, weights: list[WeightSpec]):
        self.name = name
        self.layer = layer
        self.weights: tuple[WeightSpec, ...] = tuple(weights)

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.weights)

    def pieces(self) -> dict[str, tuple[WeightSpec, ...]]:
        """Weights grouped by placement piece (``main``, ``expert.0``, ...)."""
        groups: dict[str, list[WeightSpec]] = {}
        for spec in self.weights:
            groups.setdefault(spec.piece, []).append(spec)
        return {k: tuple(v) for k, v in groups.items()}

    # Kernel launches of one forward (roughly): the per-step overhead the estimator charges.
    launches: int = 8

    def cost(self, n_tokens: int, context: int) -> Cost:
        """Work for ``n_tokens`` new tokens attending to ``context`` tokens in total."""
        raise NotImplementedError

    def matmuls(self, n_tokens: int) -> list[tuple[float, int, int]]:
        """The weight matmuls of one forward as (M, K, N): [M, K] @ [K, N]; M may be fractional
        (an expected token count per expert)."""
        return []

    def forward(self, w: Mapping[str, torch.Tensor], x: torch.Tensor, step: Step) -> torch.Tensor:
        """Compute on the device of ``x``; ``w`` maps ``WeightSpec.key`` to tensors."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name}, {len(self.weights)} weights, {self.nbytes} B)"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` with the Hugging Face weight layout [out, in].

    Few-token half-precision projections on the CPU take the path measured fastest for their
    shape (:mod:`vramshard.layers.cpu_linear`); everything else is ``F.linear``.
    """
    if x.device.type == "cpu":
        return cpu_linear(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)
