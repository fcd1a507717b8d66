"""Whether the VRAM buffers a placement switch dropped are gone once dropped.

A switch drops its references to the old placement's buffers and empties the caching allocator;
a buffer a reference cycle still holds comes back only after ``gc.collect`` (about 0.1 s in a
process holding a model). The executor inferred that from the process's reserved VRAM alone, which
counts every engine of the process: with two engines loaded (``benchmarks/paired_decode.py``), the
first one's every switch collected (137–243 ms on the H200 machine, forty-fifth GPU session,
docs/BENCHMARKS.md). Weak references ask the buffers themselves first.
"""

from __future__ import annotations

import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef


class DroppedBuffers:
    """Weak references to what a switch drops: tensors by their storage (any tensor over it keeps it,
    not only a view of the one watched), other holders (a slot ring, an expert cache, decode graphs)
    as objects."""

    def __init__(self) -> None:
        self._storages: list[StorageWeakRef] = []
        self._objects: list[weakref.ref] = []

    def watch(self, *things: object) -> None:
        """Watch each of ``things`` (None is skipped)."""
        for thing in things:
            if thing is None:
                continue
            if isinstance(thing, torch.Tensor):
                self._storages.append(StorageWeakRef(thing.untyped_storage()))
            else:
                self._objects.append(weakref.ref(thing))

    def held(self) -> int:
        """How many watched buffers something still holds (0: all were freed with their last reference)."""
        return sum(not ref.expired() for ref in self._storages) + sum(ref() is not None for ref in self._objects)
