"""The ring of VRAM slots that streamed sub-layers are copied into.

The copy stream fills slots in the order the streamed sub-layers run, cyclically (the
last sub-layer of a step is followed by the first of the next step, so the next step's
first weights are already on their way while the current step ends). Two events per
slot order the work: ``filled`` (copy done → compute may read) and ``free`` (compute
done → the copy may overwrite).

An item of the ring's order is a sub-layer name (its whole packed buffer streams) or, for a
dense FFN split between the CPU and the GPU, ``(name, first)``: only its GPU part, pieces
``first..P-1`` (:class:`~vramshard.runtime.host_weights.SplitPart`), streams, so the copy
engine fills the next layer's GPU part while the CPU computes this layer's CPU part.

A ring made ``coded`` (the executor's, with ``VRAMSHARD_WIRE_CODEC`` on a bf16 model) fills the sub-layers
whose host weights have coded blocks (:class:`~vramshard.runtime.wire_codec.CodedBuffer`) from them: they
cross the link in about 0.75 of their bytes, through the ring's one staging buffer, and are decoded on a
stream of their own where the ring has a decode stream (each round beside the next round's copy:
:class:`~vramshard.runtime.wire_codec.OverlappedDecode`), else on the copy stream; the copy stream waits
for a fill's last decode before the slot's ``filled`` event, which still marks the weights ready.

Sub-layers pinned in VRAM coded (:class:`~vramshard.runtime.vram_coded.VramCoded`, ``vram_coded``) take their
turn in the ring's order too: their fill is a decode from VRAM on the ring's ``decode_stream``, so it runs
beside the copy engine's fills rather than queued behind them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from ..plan.memory import align
from .host_weights import PackedWeights
from .vram_coded import VramCoded
from .wire_codec import STAGING_BYTES, FillStats, OverlappedDecode

StreamItem = str | tuple[str, int]  # a sub-layer streamed whole, or (dense FFN, first GPU piece) of a split


def item_bytes(host: dict[str, PackedWeights], item: StreamItem) -> int:
    """Bytes one fill of ``item`` needs in a slot."""
    if isinstance(item, tuple):
        name, first = item
        return host[name].layout.split_part(first).nbytes
    return host[item].layout.nbytes


@dataclass
class Slot:
    buffer: torch.Tensor  # uint8 in VRAM
    filled: torch.cuda.Event
    free: torch.cuda.Event
    views: dict  # stream item -> {key: view into buffer}, made once per layout


class SlotRing:
    """Streams the weights of ``order`` (stream items, run order) through ``num_slots`` slots; ``coded``:
    from the host weights' coded blocks where they have them (else raw, as without the codec);
    ``vram_coded``: sub-layers kept coded in VRAM, filled by a decode on ``decode_stream``."""

    def __init__(self, slot_bytes: int, host: dict[str, PackedWeights], num_slots: int,
                 device: torch.device, copy_stream: torch.cuda.Stream, coded: bool = False,
                 vram_coded: dict[str, VramCoded] | None = None, decode_stream: torch.cuda.Stream | None = None):
        self.order: list[StreamItem] = []
        self.host = host
        self.copy_stream = copy_stream
        self.slots = [
            Slot(torch.empty(slot_bytes, dtype=torch.uint8, device=device), torch.cuda.Event(), torch.cuda.Event(), {})
            for _ in range(num_slots)
        ]
        self.slot_bytes = slot_bytes
        self.pending: deque[tuple[StreamItem, Slot]] = deque()  # fills issued, not yet used, in order
        self._next_index = 0  # position in `order` of the next sub-layer to fill
        self._next_slot = 0
        self.fills = FillStats()  # bytes over the link, and the raw bytes they stood for
        self.coded = coded
        self.staging = torch.empty(STAGING_BYTES, dtype=torch.uint8, device=device) if coded else None
        self.vram_coded = vram_coded or {}
        if self.vram_coded and decode_stream is None:
            raise ValueError("a ring with sub-layers coded in VRAM needs a decode stream")
        self.decode_stream = decode_stream
        self.decodes = 0  # fills decoded from VRAM so far
        # Coded fills' rounds: through the staging's halves, decoded on a stream of their own (where the ring has a
        # decode stream: on a GPU). Not on the pins' decode stream, which runs in order: a pin's decode queued there
        # behind a link fill's rounds waited for that fill's copies, and a round behind a pin's decode waited for
        # the pin's slot to be freed, the copy engine with it.
        self.overlap = OverlappedDecode(self.staging, torch.cuda.Stream(device=device)) \
            if self.staging is not None and decode_stream is not None else None

    def set_order(self, order: list[StreamItem]) -> None:
        """The stream items of the placement about to run, in run order."""
        if order != self.order:
            self.order = list(order)
            self.pending.clear()
            self._next_index = 0

    @property
    def nbytes(self) -> int:
        return self.slot_bytes * len(self.slots) + (self.staging.numel() if self.staging is not None else 0)

    @property
    def bytes_copied(self) -> int:
        """Bytes the fills so far moved over the link."""
        return self.fills.wire

    def _issue_fill(self) -> None:
        item = self.order[self._next_index % len(self.order)]
        slot = self.slots[self._next_slot % len(self.slots)]
        coded = self.vram_coded.get(item) if isinstance(item, str) else None
        if coded is not None:
            self._decode(coded, slot)
        else:
            self._copy(item, slot)
        self.pending.append((item, slot))
        self._next_index += 1
        self._next_slot += 1

    def _decode(self, coded: VramCoded, slot: Slot) -> None:
        """Fill ``slot`` with a sub-layer pinned coded: decoded in VRAM, beside the copy engine's fills."""
        with torch.cuda.stream(self.decode_stream):
            self.decode_stream.wait_event(slot.free)  # the previous user of the slot is done
            coded.decode(slot.buffer[: coded.nbytes])
            slot.filled.record(self.decode_stream)
        self.decodes += 1

    def _copy(self, item: StreamItem, slot: Slot) -> None:
        """Fill ``slot`` with ``item`` from host memory over the link (coded where the ring codes)."""
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(slot.free)  # the previous user of the slot is done
            name = item[0] if isinstance(item, tuple) else item
            packed = self.host[name]
            # The GPU part of a split FFN: a few contiguous ranges; else the whole buffer.
            ranges = packed.layout.split_part(item[1]).copies if isinstance(item, tuple) \
                else ((0, packed.layout.nbytes, 0),)
            for begin, end, at in ranges:
                target = slot.buffer[at : at + end - begin]
                if self.coded and packed.coded is not None:
                    packed.coded.fill(target, begin, end, self.staging, self.fills, self.overlap)
                else:
                    target.copy_(packed.buffer[begin:end], non_blocking=True)
                    self.fills.wire += end - begin
                    self.fills.raw += end - begin
            slot.filled.record(self.copy_stream)

    def acquire(self, name: StreamItem, compute_stream: torch.cuda.Stream) -> dict[str, torch.Tensor]:
        """Weights of stream item ``name`` in VRAM (for a split FFN's GPU part: the part's views,
        :meth:`SplitPart.views`); the compute stream waits until they have arrived."""
        if not self.pending:
            self._prime(name)
        if self.pending[0][0] != name:
            # Out of ring order (a new placement, or a step that skipped sub-layers): restart here.
            self.pending.clear()
            self._prime(name)
        _, slot = self.pending.popleft()
        compute_stream.wait_event(slot.filled)
        if name not in slot.views:
            if isinstance(name, tuple):
                slot.views[name] = self.host[name[0]].layout.split_part(name[1]).views(slot.buffer)
            else:
                slot.views[name] = self.host[name].layout.views(slot.buffer)
        self._current = slot
        return slot.views[name]

    def release(self, compute_stream: torch.cuda.Stream) -> None:
        """The compute of the last acquired sub-layer is queued: its slot may be refilled after it."""
        self._current.free.record(compute_stream)
        self._issue_fill()

    def _prime(self, name: StreamItem) -> None:
        self._next_index = self.order.index(name)
        for _ in range(min(len(self.slots), len(self.order))):
            self._issue_fill()


class ExpertSlotBuffer:
    """The layout side of the VRAM expert cache: ``capacity`` slots of ``slot_bytes`` in one buffer
    (on any device), one expert per slot, read through views that are shared by all slots of one
    expert shape. :class:`ExpertSlots` adds the copies and their ordering on a GPU."""

    def __init__(self, capacity: int, slot_bytes: int, host: dict[str, PackedWeights], device: torch.device):
        self.host = host
        self.capacity = capacity
        self.slot_bytes = slot_bytes
        self.device = device
        self.buffer = torch.empty(capacity * slot_bytes, dtype=torch.uint8, device=device)
        self._ranges: dict[str, list[tuple[int, int]]] = {}  # sub-layer -> byte range of each expert
        self._views: dict[tuple, object] = {}  # (slot, expert shape) -> ExpertTensors
        self._stacked: dict[tuple, object] = {}  # expert shape -> StackedExperts over all slots (or None)
        self._shapes: dict[str, tuple] = {}  # sub-layer -> shape of its experts in a slot

    def _range(self, name: str, expert: int) -> tuple[int, int]:
        if name not in self._ranges:
            layout = self.host[name].layout
            spans: dict[int, tuple[int, int]] = {}
            for spec, offset in zip(layout.specs, layout.offsets):
                if spec.piece.startswith("expert."):
                    e = int(spec.piece.split(".")[1])
                    begin, end = spans.get(e, (offset, offset))
                    spans[e] = (min(begin, offset), max(end, offset + align(spec.nbytes)))
            self._ranges[name] = [spans[e] for e in range(len(spans))]
        return self._ranges[name][expert]

    def target(self, slot: int, name: str, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot bytes, host bytes) of copying ``expert`` of ``name`` into ``slot``."""
        begin, end = self._range(name, expert)
        nbytes = end - begin
        assert nbytes <= self.slot_bytes, "expert larger than a cache slot"
        return self.buffer[slot * self.slot_bytes : slot * self.slot_bytes + nbytes], self.host[name].buffer[begin:end]

    def view(self, slot: int, name: str):
        shape = self._shape_of(name)
        key = (slot, shape)
        if key not in self._views:
            from ..layers.moe import ExpertTensors

            base = slot * self.slot_bytes
            parts = {}
            for part, offset, nbytes, dtype, dims in shape:
                parts[part] = self.buffer[base + offset : base + offset + nbytes].view(dtype).view(dims)
            (_, g_off, g_bytes, dtype, g_dims), (_, u_off, u_bytes, _, u_dims) = shape[0], shape[1]
            gate_up = None
            if g_off + g_bytes == u_off and g_dims[1:] == u_dims[1:]:
                gate_up = self.buffer[base + g_off : base + u_off + u_bytes].view(dtype).view(
                    g_dims[0] + u_dims[0], *g_dims[1:])
            self._views[key] = ExpertTensors(parts["gate"], parts["up"], parts["down"], gate_up)
        return self._views[key]

    def stacked(self, name: str):
        """Every slot as one row of strided [capacity, 2F, D] / [capacity, D, F] views (no copy),
        laid out as ``name``'s experts; None when gate and up do not lie back to back."""
        from ..layers.moe import StackedExperts

        shape = self._shape_of(name)
        if shape not in self._stacked:
            first = self.view(0, name)
            stacked = None
            if first.gate_up is not None and all(self.slot_bytes % t.element_size() == 0
                                                 for t in (first.gate_up, first.down)):
                stacked = StackedExperts(*(t.as_strided((self.capacity, *t.shape),
                                                        (self.slot_bytes // t.element_size(), *t.stride()))
                                           for t in (first.gate_up, first.down)))
            self._stacked[shape] = stacked
        return self._stacked[shape]

    def _shape_of(self, name: str) -> tuple:
        """(part, offset in the slot, bytes, dtype, shape) of gate, up, down: the same for every
        expert of a layer (and of every layer of one model), so slot views are shared."""
        if name not in self._shapes:
            layout = self.host[name].layout
            begin, _ = layout.piece_range("expert.0")
            by_key = {spec.key: (spec, offset) for spec, offset in zip(layout.specs, layout.offsets)
                      if spec.piece == "expert.0"}
            self._shapes[name] = tuple((part, by_key[f"experts.0.{part}"][1] - begin, by_key[f"experts.0.{part}"][0].nbytes,
                                        by_key[f"experts.0.{part}"][0].dtype, tuple(by_key[f"experts.0.{part}"][0].shape))
                                       for part in ("gate", "up", "down"))
        return self._shapes[name]


class ExpertSlots(ExpertSlotBuffer):
    """The CUDA side of the VRAM expert cache (:class:`~vramshard.runtime.expert_cache.ExpertCache`):
    the slots of :class:`ExpertSlotBuffer` in VRAM, two events per slot as in the ring
    (``filled``: copy done; ``free``: the compute reading it is done), and one copy per expert
    from the sub-layer's packed (pinned) host buffer, where its tensors lie together."""

    def __init__(self, capacity: int, slot_bytes: int, host: dict[str, PackedWeights], device: torch.device,
                 copy_stream: torch.cuda.Stream):
        super().__init__(capacity, slot_bytes, host, device)
        self.copy_stream = copy_stream
        self.filled = [torch.cuda.Event() for _ in range(capacity)]
        self.free = [torch.cuda.Event() for _ in range(capacity)]
        # slot -> the stream that already waits for the slot's current fill: a cached expert read
        # step after step needs no new wait (each is a host call, eight a layer at decode).
        self._waited: dict[int, torch.cuda.Stream] = {}
        # Recorded after kernels that read slots by table (runtime/zero_copy_experts), whichever
        # slots the routing picked on the GPU: every later fill waits for it.
        self._table_reads: torch.cuda.Event | None = None

    def fill(self, slot: int, name: str, expert: int) -> int:
        target, source = self.target(slot, name, expert)
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self.free[slot])  # the last compute reading the slot is done
            if self._table_reads is not None:
                self.copy_stream.wait_event(self._table_reads)
            target.copy_(source, non_blocking=True)
            self.filled[slot].record(self.copy_stream)
        self._waited.pop(slot, None)  # a new fill: its readers wait for it again
        return target.numel()

    def ready(self, slot: int) -> None:
        stream = torch.cuda.current_stream(self.device)
        if self._waited.get(slot) == stream:
            return  # this stream is already ordered after the slot's current fill
        stream.wait_event(self.filled[slot])
        self._waited[slot] = stream

    def done(self, slot: int) -> None:
        self.done_many([slot])

    def read_by_table(self) -> None:
        """Kernels that may read any slot are queued on the current stream: no slot is refilled
        before they are done."""
        if self._table_reads is None:
            self._table_reads = torch.cuda.Event()
        self._table_reads.record(torch.cuda.current_stream(self.device))

    def done_many(self, slots) -> None:
        """The compute reading ``slots`` is queued: one event, recorded after it, frees them all."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        for slot in slots:
            self.free[slot] = event
