"""Buffers for the CPU part of a split FFN, made once and reused step after step.

At many rows (a batch of decodes, a prompt chunk) the CPU part of a split FFN makes
multi-megabyte tensors every layer: the [T, r] gate and up products and the [T, D] result.
Fresh ones cost the host allocator's work each call (and page faults for the blocks it hands
back to the OS), and a result in pageable memory goes to the GPU through the driver's staging
buffer with the host blocked on the copy. Here the products land in one reused buffer and the
result in pinned memory, so its copy to the GPU is queued like any other.

A result buffer is read by a copy still on its way to the GPU when the next layer's CPU part
wants one: two alternate, and each waits for the copy that last read it (long done by then: a
whole layer of work lies between).

``VRAMSHARD_SPLIT_BUFFERS=off`` computes the CPU part as before (fresh tensors, pageable
result), to measure what the buffers bring.
"""

from __future__ import annotations

import os

import torch

from ..layers.cpu_linear import MAX_TOKENS

ENABLED = os.environ.get("VRAMSHARD_SPLIT_BUFFERS", "on").lower() not in ("off", "0", "false", "no")


class SplitBuffers:
    """The reused buffers of one executor's split FFNs (its host thread alone uses them)."""

    def __init__(self, pinned: bool):
        self.pinned = pinned
        self._work: torch.Tensor | None = None
        self._results: list[torch.Tensor | None] = [None, None]
        self._read: list[torch.cuda.Event | None] = [None, None]  # the copy that last read each result
        self._turn = 0

    @staticmethod
    def wanted(rows: int) -> bool:
        """Whether a CPU part of ``rows`` rows uses the buffers: few-token parts take the
        projections tuned per shape (:mod:`~vramshard.layers.cpu_linear`) and make small tensors."""
        return ENABLED and rows > MAX_TOKENS

    def work(self, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        """A [2, rows, width] buffer for the gate and up products (its contents are overwritten)."""
        self._work = _at_least(self._work, 2 * rows * width, dtype, pinned=False)
        return self._work[:2 * rows * width].view(2, rows, width)

    def result(self, rows: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
        """A [rows, hidden] buffer for the CPU part's output, free of any copy still reading it;
        call :meth:`copying` once its copy to the GPU is queued."""
        turn = self._turn = 1 - self._turn
        if self._read[turn] is not None:
            self._read[turn].synchronize()
            self._read[turn] = None
        self._results[turn] = _at_least(self._results[turn], rows * hidden, dtype, self.pinned)
        return self._results[turn][:rows * hidden].view(rows, hidden)

    def copying(self) -> None:
        """The last :meth:`result` buffer is being read by a copy queued on the current stream."""
        if self.pinned:
            event = torch.cuda.Event()
            event.record()
            self._read[self._turn] = event


def _at_least(buffer: torch.Tensor | None, numel: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """``buffer`` if it holds ``numel`` elements of ``dtype``, else a new one that does."""
    if buffer is not None and buffer.dtype == dtype and buffer.numel() >= numel:
        return buffer
    return torch.empty(numel, dtype=dtype, pin_memory=pinned)
