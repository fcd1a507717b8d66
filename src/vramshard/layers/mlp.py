"""``ffn[i]`` for dense models: pre-norm, SwiGLU MLP, residual."""

from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F

from ..config import ModelArgs
from .norm import rms_norm
from .step import Step
from .sublayer import Cost, SubLayer, WeightSpec, linear


def swiglu(h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """``down(silu(gate(h)) * up(h))``."""
    return linear(F.silu(linear(h, gate)) * linear(h, up), down)


def swiglu_fused(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The same with gate and up stacked in one [2F, D] weight: one matmul instead of two."""
    gate, up = linear(h, gate_up).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, down)


class DenseFFN(SubLayer):
    kind = "ffn"
    fusable = {"gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, args: ModelArgs, layer: int, prefix: str, dtype: torch.dtype):
        self.eps = args.rms_norm_eps
        d, f = args.hidden_size, args.intermediate_size
        super().__init__(f"ffn[{layer}]", layer, [
            WeightSpec("post_attention_layernorm", f"{prefix}.post_attention_layernorm.weight", (d,), dtype),
            WeightSpec("gate_proj", f"{prefix}.mlp.gate_proj.weight", (f, d), dtype),
            WeightSpec("up_proj", f"{prefix}.mlp.up_proj.weight", (f, d), dtype),
            WeightSpec("down_proj", f"{prefix}.mlp.down_proj.weight", (d, f), dtype),
        ])
        self.hidden, self.intermediate = d, f

    launches = 9

    def matmuls(self, n_tokens: int) -> list[tuple[float, int, int]]:
        return [(n_tokens, self.hidden, 2 * self.intermediate), (n_tokens, self.intermediate, self.hidden)]

    def cost(self, n_tokens: int, context: int) -> Cost:
        itemsize = self.weights[0].dtype.itemsize
        return Cost(flops=2 * n_tokens * 3 * self.hidden * self.intermediate, weight_bytes=self.nbytes,
                    act_bytes=2 * n_tokens * self.hidden * itemsize)

    def forward(self, w: Mapping[str, torch.Tensor], x: torch.Tensor, step: Step) -> torch.Tensor:
        h = rms_norm(x, w["post_attention_layernorm"], self.eps)
        if "gate_up_proj" in w:
            return x + swiglu_fused(h, w["gate_up_proj"], w["down_proj"])
        return x + swiglu(h, w["gate_proj"], w["up_proj"], w["down_proj"])
