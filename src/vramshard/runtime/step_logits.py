"""A step's logits where the head computed them, and the sampled token ids read from them.

Copying a step's float32 logits to the host costs ``rows x vocab x 4`` bytes (33 MB for 64
sequences of a 131k vocabulary) and sampling each row there costs a pass over it per row. Most
rows sample greedily from the raw logits and need only their argmax, so :class:`StepLogits`
takes the argmax of every row in one kernel where the logits are, and brings only the rows whose
samplers read the whole distribution (temperature, penalties, log-probabilities) to the host.

:class:`TokenIds` holds the argmax on the device and its copy on its way to the host. The next
decode step can read the device copy as its input tokens before the host has seen them (see
:mod:`~vramshard.runtime.scheduler`, which queues a decode step before reading the one before).

Both run their kernels on the stream that computed the logits (the executor's compute stream),
so they are ordered after the step and before anything queued later on that stream.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch


def _on(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _index(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """int64 ``values`` on ``device`` without waiting for the stream (a pinned source on a GPU)."""
    host = torch.tensor(list(values), dtype=torch.long)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class TokenIds:
    """Token ids [R] int64 on the logits' device, with their host copy (ready once :meth:`tolist` returns)."""

    def __init__(self, ids: torch.Tensor, stream=None):
        self.device_ids = ids
        self._stream = stream
        self._host = ids
        self._ready = None
        if ids.is_cuda:
            with _on(stream):
                self._host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
                self._host.copy_(ids, non_blocking=True)
                self._ready = torch.cuda.Event()
                self._ready.record()

    @property
    def on_gpu(self) -> bool:
        return self.device_ids.is_cuda

    def tolist(self) -> list[int]:
        """The ids on the host (waits for their copy)."""
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()

    def feed(self, sources: Sequence[int], host_ids: Sequence[int]) -> torch.Tensor:
        """Input ids [T] of a next step on this device: token i is row ``sources[i]`` of these ids
        where ``sources[i] >= 0``, else ``host_ids[i]``. Queued on the stream that made the ids."""
        rows = [s for s in sources if s >= 0]
        device = self.device_ids.device
        with _on(self._stream):
            if len(rows) == len(sources):
                if rows == list(range(self.device_ids.shape[0])):
                    return self.device_ids
                return self.device_ids.index_select(0, _index(rows, device))
            ids = _index(host_ids, device)
            where = _index([i for i, s in enumerate(sources) if s >= 0], device)
            ids[where] = self.device_ids.index_select(0, _index(rows, device))
            return ids


class StepLogits:
    """Float32 logits [R, V] of one step on the device of the head, computed on ``stream``.

    Read them before the next forward step: on a GPU their memory may be a CUDA graph's static
    output, which the next replay overwrites."""

    def __init__(self, logits: torch.Tensor, stream=None):
        self.logits = logits
        self.stream = stream

    def __len__(self) -> int:
        return self.logits.shape[0]

    @property
    def device(self) -> torch.device:
        return self.logits.device

    def argmax(self) -> TokenIds:
        """Every row's argmax (the first maximum, as ``torch.argmax``), in one kernel; the host copy
        is queued, not waited for."""
        with _on(self.stream):
            return TokenIds(self.logits.argmax(dim=-1), self.stream)

    def rows(self, indices: Sequence[int]) -> torch.Tensor:
        """Float32 rows [len(indices), V] on the host (one copy; waits for it)."""
        with _on(self.stream):
            if list(indices) == list(range(len(self))):
                return self.logits.float().cpu()
            return self.logits.index_select(0, _index(indices, self.device)).float().cpu()
