"""Choosing the next token from logits: greedy, or temperature with top-k / top-p."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InvalidInputError


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise InvalidInputError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidInputError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InvalidInputError(f"top_p must be in (0, 1], got {self.top_p}")


class Sampler:
    """Samples for one sequence; owns its random generator so results do not depend on batching."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        """logits [V] (any device) → token id."""
        p = self.params
        if p.temperature == 0:
            return int(torch.argmax(logits))
        logits = logits.float().cpu() / p.temperature
        if p.top_k and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (always at least one token).
            drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
            sorted_probs[drop] = 0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self.generator))
