"""Host copies of the weights, one packed (and, with CUDA, pinned) buffer per sub-layer.

Packing a sub-layer's tensors into one buffer lets the copy engine move it to a VRAM
slot with a single transfer at full PCIe speed, and gives every slot the same layout
(the same offsets) so weight views into a slot are made once.

A dense FFN is packed so it can also be *split* (:class:`SplitPart`): its ``down_proj`` is
stored transposed ([F, D]), so the rows of gate and up and the columns of down of the pieces
``first..P-1`` are three contiguous byte ranges of the host buffer (four with the norm), and
the GPU part of a split is copied into a slot with one copy each; the CPU part reads pieces
``0..first-1`` in place. Whole-FFN views are unchanged for ``forward`` (down is a transposed
[D, F] view of the [F, D] storage), so resident, streamed, CPU and CUDA-graph paths read the
same tensors as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..layers import cpu_gemv
from ..layers.mlp import DenseFFN
from ..layers.sublayer import SubLayer, WeightSpec
from ..plan.memory import align
from .pinned_host import host_empty, pinned_empty
from .wire_codec import CodedBuffer


@dataclass
class PackedLayout:
    """Byte offsets of a sub-layer's tensors inside one buffer."""

    specs: tuple[WeightSpec, ...]
    offsets: tuple[int, ...]
    nbytes: int
    fusable: dict = None  # SubLayer.fusable
    transposed: frozenset = frozenset()  # keys stored as the transpose of their spec's shape
    bounds: tuple[int, ...] = ()  # a dense FFN's piece boundaries (rows of the intermediate dimension)
    _parts: dict = field(default_factory=dict, repr=False, compare=False)  # first piece -> SplitPart

    @classmethod
    def of(cls, sublayer: SubLayer, splittable: bool = True) -> "PackedLayout":
        """``splittable``: lay a dense FFN out in pieces (down_proj transposed) so it can be split
        between the CPU and the GPU; False keeps every tensor as its checkpoint stores it."""
        offsets, cursor = [], 0
        for spec in sublayer.weights:
            offsets.append(cursor)
            cursor += align(spec.nbytes)
        dense = isinstance(sublayer, DenseFFN) and splittable
        return cls(sublayer.weights, tuple(offsets), cursor, dict(sublayer.fusable),
                   frozenset(sublayer.stored_transposed) if dense else frozenset(),
                   tuple(sublayer.bounds) if dense else ())

    @property
    def splittable(self) -> bool:
        """Whether this is a dense FFN packed in pieces (:meth:`split_part` works)."""
        return len(self.bounds) > 2 and "down_proj" in self.transposed

    def split_part(self, first: int) -> "SplitPart":
        """The GPU part of a split of this dense FFN: pieces ``first..P-1`` and the norm."""
        if not self.splittable or not 0 < first < len(self.bounds) - 1:
            raise ValueError(f"cannot split at piece {first}: the layout has pieces {self.bounds}")
        if first not in self._parts:
            self._parts[first] = SplitPart.of(self, first)
        return self._parts[first]

    def piece_range(self, piece: str) -> tuple[int, int]:
        """Byte range [begin, end) of one placement piece (``main``, ``expert.E``); its tensors
        are consecutive in the layout, so one copy moves the piece."""
        spans = [(offset, offset + align(spec.nbytes)) for spec, offset in zip(self.specs, self.offsets)
                 if spec.piece == piece]
        if not spans:
            raise KeyError(f"no piece {piece!r} in this layout")
        begin, end = spans[0][0], spans[-1][1]
        assert sum(e - b for b, e in spans) == end - begin, f"piece {piece} is not contiguous"
        return begin, end

    def views(self, buffer: torch.Tensor, piece: str | None = None) -> dict[str, torch.Tensor]:
        """{key: tensor} views into a uint8 ``buffer`` laid out like this, plus free fused views.

        With ``piece``, ``buffer`` holds only that piece's byte range and only its keys are made.
        """
        out, where = {}, {}
        base = self.piece_range(piece)[0] if piece is not None else 0
        for spec, offset in zip(self.specs, self.offsets):
            if piece is not None and spec.piece != piece:
                continue
            offset -= base
            raw = buffer[offset : offset + spec.nbytes]
            if spec.key in self.transposed:  # stored [cols, rows]: the forward sees the usual shape
                out[spec.key] = raw.view(spec.dtype).view(spec.shape[::-1]).t()
                continue
            out[spec.key] = raw.view(spec.dtype).view(spec.shape)
            where[spec.key] = (spec, offset)
        for fused, members in (self.fusable or {}).items():
            if all(m in where for m in members) and _back_to_back([where[m] for m in members]):
                first, offset = where[members[0]]
                rows = sum(where[m][0].shape[0] for m in members)
                nbytes = sum(where[m][0].nbytes for m in members)
                out[fused] = buffer[offset : offset + nbytes].view(first.dtype).view(rows, *first.shape[1:])
        return out


def _back_to_back(parts: list[tuple[WeightSpec, int]]) -> bool:
    """Same dtype and trailing shape, each starting where the previous one ends."""
    first = parts[0][0]
    for (spec, offset), (next_spec, next_offset) in zip(parts, parts[1:]):
        if offset + spec.nbytes != next_offset:
            return False
    return all(s.dtype == first.dtype and s.shape[1:] == first.shape[1:] for s, _ in parts)


@dataclass(frozen=True)
class SplitPart:
    """The GPU part of a split dense FFN, pieces ``first..P-1`` (rows ``rows`` of the intermediate
    dimension) and the norm, as laid out in a VRAM slot.

    copies: (host begin, host end, slot offset) of each contiguous host range: the norm, the
    gate rows, the up rows (right after the gate rows in the slot, so ``gate_up_proj`` is a free
    fused view) and the rows of the transposed down.
    """

    first: int
    rows: int
    copies: tuple[tuple[int, int, int], ...]
    nbytes: int
    _keys: tuple = field(repr=False, default=())  # (key, slot offset, dtype, shape as stored, transposed)

    @classmethod
    def of(cls, layout: PackedLayout, first: int) -> "SplitPart":
        by_key = {spec.key: (spec, offset) for spec, offset in zip(layout.specs, layout.offsets)}
        begin_row = layout.bounds[first]
        norm, norm_at = by_key["post_attention_layernorm"]
        gate, gate_at = by_key["gate_proj"]
        up, up_at = by_key["up_proj"]
        down, down_at = by_key["down_proj"]
        f, d = gate.shape
        rows, row_bytes = f - begin_row, d * gate.dtype.itemsize
        part = rows * row_bytes
        slot_gate = align(norm.nbytes)
        slot_down = slot_gate + align(2 * part)
        copies = ((norm_at, norm_at + norm.nbytes, 0),
                  (gate_at + begin_row * row_bytes, gate_at + f * row_bytes, slot_gate),
                  (up_at + begin_row * row_bytes, up_at + f * row_bytes, slot_gate + part),
                  (down_at + begin_row * row_bytes, down_at + f * row_bytes, slot_down))
        keys = (("post_attention_layernorm", 0, norm.dtype, norm.shape, False),
                ("gate_proj", slot_gate, gate.dtype, (rows, d), False),
                ("up_proj", slot_gate + part, up.dtype, (rows, d), False),
                ("down_proj", slot_down, down.dtype, (rows, d), True))
        return cls(first, rows, copies, slot_down + align(part), keys)

    def fill(self, target: torch.Tensor, host: torch.Tensor, non_blocking: bool = True) -> None:
        """Copy the part's ranges of the packed ``host`` buffer into ``target`` (uint8, a slot)."""
        for begin, end, at in self.copies:
            target[at : at + end - begin].copy_(host[begin:end], non_blocking=non_blocking)

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """{key: tensor} of the part in a ``buffer`` filled by :meth:`fill`: norm [D], gate and up
        [rows, D], gate_up_proj [2 rows, D], down [D, rows] (a transposed view)."""
        out = {}
        for key, offset, dtype, shape, transposed in self._keys:
            count = 1
            for n in shape:
                count *= n
            tensor = buffer[offset : offset + count * dtype.itemsize].view(dtype).view(shape)
            out[key] = tensor.t() if transposed else tensor
        gate_at, rows_bytes = self._keys[1][1], 2 * self.rows * self._keys[1][3][1] * self._keys[1][2].itemsize
        out["gate_up_proj"] = buffer[gate_at : gate_at + rows_bytes].view(self._keys[1][2]).view(
            2 * self.rows, self._keys[1][3][1])
        return out


@dataclass
class PackedWeights:
    layout: PackedLayout
    buffer: torch.Tensor  # uint8 [layout.nbytes]
    views: dict[str, torch.Tensor]
    coded: CodedBuffer | None = None  # the buffer's coded blocks, where its stream fills cross the link coded


def pack_sublayer(sublayer: SubLayer, weights: dict[str, torch.Tensor], pin: bool,
                  splittable: bool = True) -> PackedWeights:
    layout = PackedLayout.of(sublayer, splittable)
    buffer = _empty_host(layout.nbytes, pin)
    views = layout.views(buffer)
    for spec in sublayer.weights:
        _fill(views[spec.key], weights[spec.source])
    return PackedWeights(layout, buffer, views)


def _fill(view: torch.Tensor, source: torch.Tensor) -> None:
    """``view.copy_(source)``, writing in storage order where ``view`` is a transposed view (a split
    layout's down projection): the strided writes of a plain copy took 4.7x the time on the CPU. A
    half-precision CPU source is transposed by the C library on torch's threads where it is built
    (:func:`~vramshard.layers.cpu_gemv.transpose_into`): torch's copy runs on one thread (about 1 GB/s),
    and the split layout of llama3-8b, its downs copied so, took 5.8 s of a load on the H100 machine (the
    thirty-second GPU session)."""
    if view.dim() == 2 and not view.is_contiguous() and view.t().is_contiguous():
        if source.dtype != view.dtype or cpu_gemv.transpose_into(source.t(), view.t()) is None:
            view.t().copy_(source.t())
    else:
        view.copy_(source)


def pack_model(sublayers: list[SubLayer], weights: dict[str, torch.Tensor], pin: bool,
               splittable: bool = True) -> dict[str, PackedWeights]:
    """Pack every sub-layer; each source tensor is dropped from ``weights`` after its last use,
    so host memory peaks at the model plus one sub-layer, not twice the model. ``splittable``:
    dense FFNs laid out so plans may split them between the CPU and the GPU (see
    :meth:`PackedLayout.of`)."""
    last_use = {}
    for index, sublayer in enumerate(sublayers):
        for spec in sublayer.weights:
            last_use[spec.source] = index
    packed = {}
    for index, sublayer in enumerate(sublayers):
        packed[sublayer.name] = pack_sublayer(sublayer, weights, pin, splittable)
        for spec in sublayer.weights:
            if last_use[spec.source] == index:
                weights.pop(spec.source, None)
    return packed


def _empty_host(nbytes: int, pin: bool) -> torch.Tensor:
    """A uint8 host buffer of ``nbytes``: pinned at exactly that size where ``pin`` and CUDA allow
    (:func:`~vramshard.runtime.pinned_host.pinned_empty`), pageable memory otherwise (both on 2 MiB pages
    where the kernel gives them: :func:`~vramshard.runtime.pinned_host.host_empty`)."""
    return pinned_empty(nbytes) if pin else host_empty(nbytes)


def splits_ffns(sublayers, host: dict[str, PackedWeights]) -> bool:
    """Whether every dense FFN among ``sublayers`` is packed in ``host`` so that plans may split it
    (False also when there is none)."""
    dense = [host[s.name].layout for s in sublayers if isinstance(s, DenseFFN) and s.name in host]
    return bool(dense) and all(layout.splittable for layout in dense)


def repack(sublayers, host: dict[str, PackedWeights], splittable: bool, pin: bool) -> dict[str, PackedWeights]:
    """``host`` with its dense FFNs in the other layout (see :meth:`PackedLayout.of`); every other
    sub-layer is shared, not copied. Lets one process compare placements that split FFNs with
    placements that read the checkpoint's layout, each at its own layout's speed."""
    out = {}
    for sublayer in sublayers:
        packed = host[sublayer.name]
        if isinstance(sublayer, DenseFFN) and packed.layout.splittable != splittable:
            weights = {spec.source: packed.views[spec.key] for spec in sublayer.weights}
            out[sublayer.name] = pack_sublayer(sublayer, weights, pin, splittable)
        else:
            out[sublayer.name] = packed
    return out


class HostLayouts:
    """A model's packed host weights in the checkpoint's layout, and in the split-FFN layout made
    on first need (:func:`repack`): :meth:`for_placement` gives each placement the layout it runs
    best on — the split layout only to placements that split a dense FFN."""

    def __init__(self, sublayers, host: dict[str, PackedWeights], pin: bool = True):
        self.sublayers = list(sublayers)
        self.plain = host if not splits_ffns(self.sublayers, host) else repack(self.sublayers, host, False, pin)
        self.pin = pin
        self._split: dict[str, PackedWeights] | None = host if splits_ffns(self.sublayers, host) else None

    @property
    def split(self) -> dict[str, PackedWeights]:
        if self._split is None:
            self._split = repack(self.sublayers, self.plain, True, self.pin)
        return self._split

    def for_placement(self, placement) -> dict[str, PackedWeights]:
        """``placement``: a Placement or TieredPlacement (None: a planned engine, which may split)."""
        if placement is None:
            return self.split
        placements = getattr(placement, "placements", (placement,))
        return self.split if any(p.split_names() for p in placements) else self.plain
