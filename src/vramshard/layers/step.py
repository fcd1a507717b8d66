"""What one forward step computes: which sequences, which new tokens, which cache rows.

A :class:`Step` is built by the engine from plain Python lists and handed to every
sub-layer. It derives index tensors once per device (the first sub-layer on a device
pays for the transfer, later ones reuse it) and gives attention sub-layers their
layer's KV cache through ``kv(layer)``; where that cache lives is the executor's choice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch


class LayerKV(Protocol):
    """The KV cache of one attention layer (see ``vramshard.runtime.kv_cache``)."""

    k: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]
    v: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]
    block_size: int  # positions per block
    blocks_per_slot: int  # without block tables, slot s owns blocks s * blocks_per_slot onwards


@dataclass
class Step:
    """One forward step over a batch of sequences.

    Tokens of all sequences are concatenated: sequence b owns ``lengths[b]`` new tokens
    at positions ``starts[b] .. starts[b] + lengths[b] - 1`` and keeps its cache in row
    ``slots[b]`` of every layer's KV cache. ``logit_rows`` selects the token rows the
    head computes logits for (None: all rows).

    Multimodal models add two optional inputs: ``rope_positions``, the positions the
    rotary embedding uses when they differ from the cache positions ([T], or [3, T] for
    multimodal rotary), and ``input_embeds`` = (rows [K], vectors [K, D]), embeddings
    (image features) that replace those of the token rows ``rows``.

    ``block_tables``: with a paged KV cache, sequence b's blocks in position order (covering at
    least ``starts[b] + lengths[b]`` positions); None: slot s owns a fixed row of blocks.
    """

    slots: list[int]
    starts: list[int]
    lengths: list[int]
    logit_rows: list[int] | None = None
    kv_lookup: Callable[[int], LayerKV] | None = None
    rope_positions: torch.Tensor | None = None  # int64 [T] or [3, T]; None: positions()
    input_embeds: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows [K] int64, vectors [K, D])
    block_tables: list[list[int]] | None = None  # per sequence: its KV blocks in position order
    _memo: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if not (len(self.slots) == len(self.starts) == len(self.lengths)):
            raise ValueError("slots, starts and lengths must have one entry per sequence")
        if any(n <= 0 for n in self.lengths):
            raise ValueError("every sequence in a step needs at least one new token")

    @classmethod
    def single(cls, start: int, length: int, slot: int = 0, all_logits: bool = False, **kw) -> "Step":
        """A step of one sequence: ``length`` new tokens after ``start`` cached ones."""
        rows = None if all_logits else [length - 1]
        return cls([slot], [start], [length], rows, **kw)

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def num_seqs(self) -> int:
        return len(self.slots)

    @property
    def max_context(self) -> int:
        """Longest cached length after this step, over the batch."""
        return max(s + n for s, n in zip(self.starts, self.lengths))

    def kv(self, layer: int) -> LayerKV:
        if self.kv_lookup is None:
            raise RuntimeError("this step has no KV cache attached")
        return self.kv_lookup(layer)

    def memo(self, key, device: torch.device, build: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Per-step cache of derived tensors, one copy per device."""
        full_key = (key, str(device))
        if full_key not in self._memo:
            self._memo[full_key] = build()
        return self._memo[full_key]

    def positions(self, device: torch.device) -> torch.Tensor:
        """Absolute position of every new token [T] (int64)."""
        def build():
            pos = [s + i for s, n in zip(self.starts, self.lengths) for i in range(n)]
            return torch.tensor(pos, dtype=torch.long).to(device, non_blocking=True)

        return self.memo("positions", device, build)

    def rotary_positions(self, device: torch.device) -> torch.Tensor:
        """Positions for the rotary embedding: ``rope_positions`` if given, else ``positions()``."""
        if self.rope_positions is None:
            return self.positions(device)
        if self.rope_positions.shape[-1] != self.num_tokens:
            raise ValueError(f"rope_positions cover {self.rope_positions.shape[-1]} tokens, the step has "
                             f"{self.num_tokens}")
        return self.memo("rope_positions", device, lambda: self.rope_positions.to(device, non_blocking=True))

    def token_slots(self, device: torch.device) -> torch.Tensor:
        """Cache slot of every new token [T] (int64)."""
        def build():
            rows = [slot for slot, n in zip(self.slots, self.lengths) for _ in range(n)]
            return torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)

        return self.memo("token_slots", device, build)

    def logit_rows_tensor(self, device: torch.device) -> torch.Tensor | None:
        if self.logit_rows is None:
            return None
        return self.memo("logit_rows", device, lambda: torch.tensor(self.logit_rows, dtype=torch.long).to(device))
