"""``ffn[i]`` for Mixture-of-Experts models: pre-norm, router, routed SwiGLU experts, residual.

Every expert is its own placement piece (``expert.E``). The forward computes only the
experts that received tokens, grouping the tokens of each expert (no per-token loop).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from ..config import ModelArgs
from .mlp import swiglu
from .norm import rms_norm
from .step import Step
from .sublayer import Cost, SubLayer, WeightSpec, linear


@dataclass(frozen=True)
class ExpertNames:
    """How a checkpoint names the router and the three projections of expert E."""

    block: str  # "mlp" (Qwen3-MoE) or "block_sparse_moe" (Mixtral)
    gate: str  # "gate_proj" or "w1"
    up: str  # "up_proj" or "w3"
    down: str  # "down_proj" or "w2"


QWEN_EXPERTS = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj")
MIXTRAL_EXPERTS = ExpertNames("block_sparse_moe", "w1", "w3", "w2")


@dataclass
class Routing:
    """Which experts each token goes to, and with what weight."""

    experts: torch.Tensor  # [T, k] int64
    weights: torch.Tensor  # [T, k] in the activation dtype


class MoEFFN(SubLayer):
    kind = "ffn"

    def __init__(self, args: ModelArgs, layer: int, prefix: str, dtype: torch.dtype, names: ExpertNames):
        moe = args.moe
        assert moe is not None
        self.eps = args.rms_norm_eps
        self.num_experts, self.top_k, self.norm_topk_prob = moe.num_experts, moe.top_k, moe.norm_topk_prob
        d, f = args.hidden_size, moe.intermediate_size
        self.hidden, self.intermediate = d, f
        block = f"{prefix}.{names.block}"
        specs = [
            WeightSpec("post_attention_layernorm", f"{prefix}.post_attention_layernorm.weight", (d,), dtype),
            WeightSpec("router", f"{block}.gate.weight", (moe.num_experts, d), dtype),
        ]
        for e in range(moe.num_experts):
            piece = f"expert.{e}"
            specs += [
                WeightSpec(f"experts.{e}.gate", f"{block}.experts.{e}.{names.gate}.weight", (f, d), dtype, piece),
                WeightSpec(f"experts.{e}.up", f"{block}.experts.{e}.{names.up}.weight", (f, d), dtype, piece),
                WeightSpec(f"experts.{e}.down", f"{block}.experts.{e}.{names.down}.weight", (d, f), dtype, piece),
            ]
        super().__init__(f"ffn[{layer}]", layer, specs)

    @property
    def expert_bytes(self) -> int:
        return 3 * self.hidden * self.intermediate * self.weights[0].dtype.itemsize

    def expected_experts_touched(self, n_tokens: int) -> float:
        """Expected distinct experts hit by n tokens under uniform routing."""
        miss = (1 - self.top_k / self.num_experts) ** n_tokens
        return self.num_experts * (1 - miss)

    launches = 14  # plus about 8 per expert that receives tokens (see matmuls)

    def matmuls(self, n_tokens: int) -> list[tuple[float, int, int]]:
        hit = self.expected_experts_touched(n_tokens)
        per_expert = n_tokens * self.top_k / hit  # expected tokens of each expert hit
        out: list[tuple[float, int, int]] = [(n_tokens, self.hidden, self.num_experts)]
        for _ in range(round(hit)):
            out += [(per_expert, self.hidden, 2 * self.intermediate), (per_expert, self.intermediate, self.hidden)]
        return out

    def cost(self, n_tokens: int, context: int) -> Cost:
        itemsize = self.weights[0].dtype.itemsize
        router_bytes = self.num_experts * self.hidden * itemsize + self.hidden * itemsize
        return Cost(
            flops=2 * n_tokens * (self.num_experts * self.hidden + self.top_k * 3 * self.hidden * self.intermediate),
            weight_bytes=router_bytes + self.expected_experts_touched(n_tokens) * self.expert_bytes,
            act_bytes=2 * n_tokens * self.hidden * itemsize,
        )

    def route(self, w: Mapping[str, torch.Tensor], h: torch.Tensor) -> Routing:
        logits = linear(h, w["router"])  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_weights, top_experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
        return Routing(top_experts, top_weights.to(h.dtype))

    def forward(self, w: Mapping[str, torch.Tensor], x: torch.Tensor, step: Step) -> torch.Tensor:
        h = rms_norm(x, w["post_attention_layernorm"], self.eps)
        routing = self.route(w, h)
        return x + self.run_experts(w, h, routing)

    def run_experts(self, w: Mapping[str, torch.Tensor], h: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Sum over each token's routed experts, computing each hit expert once on its tokens."""
        T = h.shape[0]
        flat_experts = routing.experts.reshape(-1)  # [T*k]
        order = torch.argsort(flat_experts, stable=True)
        counts = torch.bincount(flat_experts, minlength=self.num_experts).tolist()
        token_of = order // self.top_k  # token index of each sorted assignment
        weight_of = routing.weights.reshape(-1)[order]
        out = torch.zeros_like(h)
        begin = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            tokens = token_of[begin : begin + count]
            y = swiglu(h[tokens], w[f"experts.{expert}.gate"], w[f"experts.{expert}.up"], w[f"experts.{expert}.down"])
            out.index_add_(0, tokens, y * weight_of[begin : begin + count, None])
            begin += count
        return out
