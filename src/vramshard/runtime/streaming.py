"""The ring of VRAM slots that streamed sub-layers are copied into.

The copy stream fills slots in the order the streamed sub-layers run, cyclically (the
last sub-layer of a step is followed by the first of the next step, so the next step's
first weights are already on their way while the current step ends). Two events per
slot order the work: ``filled`` (copy done → compute may read) and ``free`` (compute
done → the copy may overwrite).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from .host_weights import PackedWeights


@dataclass
class Slot:
    buffer: torch.Tensor  # uint8 in VRAM
    filled: torch.cuda.Event
    free: torch.cuda.Event
    views: dict  # sub-layer name -> {key: view into buffer}, made once per layout


class SlotRing:
    """Streams the weights of ``order`` (sub-layer names, run order) through ``num_slots`` slots."""

    def __init__(self, slot_bytes: int, host: dict[str, PackedWeights], num_slots: int,
                 device: torch.device, copy_stream: torch.cuda.Stream):
        self.order: list[str] = []
        self.host = host
        self.copy_stream = copy_stream
        self.slots = [
            Slot(torch.empty(slot_bytes, dtype=torch.uint8, device=device), torch.cuda.Event(), torch.cuda.Event(), {})
            for _ in range(num_slots)
        ]
        self.slot_bytes = slot_bytes
        self.pending: deque[tuple[str, Slot]] = deque()  # fills issued, not yet used, in order
        self._next_index = 0  # position in `order` of the next sub-layer to fill
        self._next_slot = 0
        self.bytes_copied = 0

    def set_order(self, order: list[str]) -> None:
        """The streamed sub-layers of the placement about to run, in run order."""
        if order != self.order:
            self.order = list(order)
            self.pending.clear()
            self._next_index = 0

    @property
    def nbytes(self) -> int:
        return self.slot_bytes * len(self.slots)

    def _issue_fill(self) -> None:
        name = self.order[self._next_index % len(self.order)]
        slot = self.slots[self._next_slot % len(self.slots)]
        packed = self.host[name]
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(slot.free)  # the previous user of the slot is done
            slot.buffer[: packed.layout.nbytes].copy_(packed.buffer, non_blocking=True)
            slot.filled.record(self.copy_stream)
        self.bytes_copied += packed.layout.nbytes
        self.pending.append((name, slot))
        self._next_index += 1
        self._next_slot += 1

    def acquire(self, name: str, compute_stream: torch.cuda.Stream) -> dict[str, torch.Tensor]:
        """Weights of ``name`` in VRAM; the compute stream waits until they have arrived."""
        if not self.pending:
            self._prime(name)
        if self.pending[0][0] != name:
            # Out of ring order (a new placement, or a step that skipped sub-layers): restart here.
            self.pending.clear()
            self._prime(name)
        _, slot = self.pending.popleft()
        compute_stream.wait_event(slot.filled)
        if name not in slot.views:
            slot.views[name] = self.host[name].layout.views(slot.buffer)
        self._current = slot
        return slot.views[name]

    def release(self, compute_stream: torch.cuda.Stream) -> None:
        """The compute of the last acquired sub-layer is queued: its slot may be refilled after it."""
        self._current.free.record(compute_stream)
        self._issue_fill()

    def _prime(self, name: str) -> None:
        self._next_index = self.order.index(name)
        for _ in range(min(len(self.slots), len(self.order))):
            self._issue_fill()
