"""``embed`` (token ids → hidden states) and ``head`` (final norm + LM head → logits)."""

from __future__ import annotations

from typing import Mapping

import torch

from ..config import ModelArgs
from .norm import rms_norm
from .step import Step
from .sublayer import Cost, SubLayer, WeightSpec, linear

EMBED_NAME = "model.embed_tokens.weight"


class Embedding(SubLayer):
    kind = "embed"
    launches = 1

    def __init__(self, args: ModelArgs, dtype: torch.dtype):
        self.hidden = args.hidden_size
        super().__init__("embed", None, [WeightSpec("embed_tokens", EMBED_NAME, (args.vocab_size, args.hidden_size), dtype)])

    def cost(self, n_tokens: int, context: int) -> Cost:
        # A gather: only the rows of the new tokens are read.
        row = self.hidden * self.weights[0].dtype.itemsize
        return Cost(flops=0, weight_bytes=n_tokens * row, act_bytes=n_tokens * row)

    def forward(self, w: Mapping[str, torch.Tensor], x: torch.Tensor, step: Step) -> torch.Tensor:
        """x: token ids [T] (int64) → hidden states [T, D]."""
        return w["embed_tokens"][x]


class Head(SubLayer):
    kind = "head"
    launches = 6

    def matmuls(self, n_tokens: int) -> list[tuple[float, int, int]]:
        return [(n_tokens, self.hidden, self.vocab)]

    def __init__(self, args: ModelArgs, dtype: torch.dtype):
        self.eps = args.rms_norm_eps
        self.hidden, self.vocab = args.hidden_size, args.vocab_size
        lm_head = EMBED_NAME if args.tie_word_embeddings else "lm_head.weight"
        super().__init__("head", None, [
            WeightSpec("norm", "model.norm.weight", (args.hidden_size,), dtype),
            WeightSpec("lm_head", lm_head, (args.vocab_size, args.hidden_size), dtype),
        ])

    def cost(self, n_tokens: int, context: int) -> Cost:
        itemsize = self.weights[0].dtype.itemsize
        return Cost(flops=2 * n_tokens * self.hidden * self.vocab, weight_bytes=self.nbytes,
                    act_bytes=n_tokens * (self.hidden + self.vocab) * itemsize)

    def forward(self, w: Mapping[str, torch.Tensor], x: torch.Tensor, step: Step) -> torch.Tensor:
        """Hidden states [T, D] → float32 logits [R, V] for the step's ``logit_rows``."""
        rows = step.logit_rows_tensor(x.device)
        if rows is not None:
            x = x[rows]
        return linear(rms_norm(x, w["norm"], self.eps), w["lm_head"]).float()
