"""Buffers for dense FFNs computed on the CPU at many rows, made once and reused step after step.

At many rows (a batch of decodes, a prompt chunk) a dense FFN on the CPU — the CPU part of a
split FFN, or a whole FFN placed on the CPU — makes multi-megabyte tensors every layer: the gate
and up products ([T, r] each) and the [T, D] result. Fresh ones cost the allocator's work and
extra passes over memory each call (on the H200 machine the out-of-place ``silu`` and ``mul``
alone took 10 ms of a batch-64 llama3-8b step), and a split's result in pageable memory goes to
the GPU through the driver's staging buffer with the host blocked on the copy. Here the products
land in one reused buffer, computed in place, and the result in a reused buffer that is pinned
where a GPU is used, so a split's copy to the GPU is queued like any other.

A result buffer may be read by a copy still on its way to the GPU when the next layer wants one:
two alternate, and each waits for the copy that last read it (long done by then: a whole layer
of work lies between).

``VRAMSHARD_FFN_BUFFERS=off`` computes these FFNs with fresh tensors as before, to measure what
the buffers bring (it was ``VRAMSHARD_SPLIT_BUFFERS`` in ``8cd32e6``, for split FFNs only).
"""

from __future__ import annotations

import time

import torch

from ..env import switch
from ..layers.cpu_linear import MAX_TOKENS

ENABLED = switch("VRAMSHARD_FFN_BUFFERS", default=True)


class FFNBuffers:
    """The reused buffers of one executor's CPU FFNs (its host thread alone uses them)."""

    def __init__(self, pinned: bool):
        self.pinned = pinned
        self._work: torch.Tensor | None = None
        self._results: list[torch.Tensor | None] = [None, None]
        self._read: list[torch.cuda.Event | None] = [None, None]  # the copy that last read each result
        self._turn = 0
        self._waited_s = 0.0  # in result(), for a copy still reading the buffer (take_waited_s)

    @staticmethod
    def wanted(rows: int) -> bool:
        """Whether a CPU FFN of ``rows`` rows uses the buffers: few-token steps take the projections
        tuned per shape (:mod:`~vramshard.layers.cpu_linear`) and make small tensors."""
        return ENABLED and rows > MAX_TOKENS

    def work(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat buffer of ``numel`` elements for the gate and up products (overwritten)."""
        self._work = _at_least(self._work, numel, dtype, pinned=False)
        return self._work[:numel]

    def result(self, rows: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
        """A [rows, hidden] buffer for an FFN's output, free of any copy still reading it; call
        :meth:`copying` once a copy to the GPU is queued from it."""
        turn = self._turn = 1 - self._turn
        if self._read[turn] is not None:
            began = time.perf_counter()
            self._read[turn].synchronize()
            self._waited_s += time.perf_counter() - began
            self._read[turn] = None
        self._results[turn] = _at_least(self._results[turn], rows * hidden, dtype, self.pinned)
        return self._results[turn][:rows * hidden].view(rows, hidden)

    def take_waited_s(self) -> float:
        """Seconds :meth:`result` has waited for copies still reading its buffers since the last call."""
        waited, self._waited_s = self._waited_s, 0.0
        return waited

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
