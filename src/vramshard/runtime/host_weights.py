"""Host copies of the weights, one packed (and, with CUDA, pinned) buffer per sub-layer.

Packing a sub-layer's tensors into one buffer lets the copy engine move it to a VRAM
slot with a single transfer at full PCIe speed, and gives every slot the same layout
(the same offsets) so weight views into a slot are made once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..layers.sublayer import SubLayer, WeightSpec
from ..plan.memory import align

log = logging.getLogger(__name__)


@dataclass
class PackedLayout:
    """Byte offsets of a sub-layer's tensors inside one buffer."""

    specs: tuple[WeightSpec, ...]
    offsets: tuple[int, ...]
    nbytes: int
    fusable: dict = None  # SubLayer.fusable

    @classmethod
    def of(cls, sublayer: SubLayer) -> "PackedLayout":
        offsets, cursor = [], 0
        for spec in sublayer.weights:
            offsets.append(cursor)
            cursor += align(spec.nbytes)
        return cls(sublayer.weights, tuple(offsets), cursor, dict(sublayer.fusable))

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


@dataclass
class PackedWeights:
    layout: PackedLayout
    buffer: torch.Tensor  # uint8 [layout.nbytes]
    views: dict[str, torch.Tensor]


def pack_sublayer(sublayer: SubLayer, weights: dict[str, torch.Tensor], pin: bool) -> PackedWeights:
    layout = PackedLayout.of(sublayer)
    buffer = _empty_host(layout.nbytes, pin)
    views = layout.views(buffer)
    for spec in sublayer.weights:
        views[spec.key].copy_(weights[spec.source])
    return PackedWeights(layout, buffer, views)


def pack_model(sublayers: list[SubLayer], weights: dict[str, torch.Tensor], pin: bool) -> dict[str, PackedWeights]:
    """Pack every sub-layer; each source tensor is dropped from ``weights`` after its last use,
    so host memory peaks at the model plus one sub-layer, not twice the model."""
    last_use = {}
    for index, sublayer in enumerate(sublayers):
        for spec in sublayer.weights:
            last_use[spec.source] = index
    packed = {}
    for index, sublayer in enumerate(sublayers):
        packed[sublayer.name] = pack_sublayer(sublayer, weights, pin)
        for spec in sublayer.weights:
            if last_use[spec.source] == index:
                weights.pop(spec.source, None)
    return packed


_pin_warned = False


def _empty_host(nbytes: int, pin: bool) -> torch.Tensor:
    global _pin_warned
    if pin:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as exc:
            if not _pin_warned:
                log.warning("cannot pin host memory (%s); streaming falls back to pageable memory, "
                            "which is slower", exc)
                _pin_warned = True
    return torch.empty(nbytes, dtype=torch.uint8)
