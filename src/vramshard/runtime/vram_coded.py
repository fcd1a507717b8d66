"""Pinned weights kept coded in VRAM, decoded into a stream slot just before they compute.

The code of :mod:`~vramshard.runtime.wire_codec` (bf16 words in 0.754 of their bytes, bit for bit) serves
weights that stay in VRAM as well as those that cross the link: where a budget holds part of a model, pinning
its sub-layers coded holds about a third more of it. Each step then pays, per coded sub-layer, one decode at
VRAM speed into a slot of the stream ring (a llama3-8b FFN's 352 MB in 0.31 ms on an H100, where its copy over
PCIe takes 6.4 ms and its product on the host's CPU more) instead of moving those bytes over the link or
reading them on the CPU. DFloat11 (Zhang et al. 2025, arXiv:2504.11651) keeps whole models coded this way
and decodes a transformer block at a time; here the planner chooses, per budget, whether coding the pinned
set pays (:class:`~vramshard.plan.planner.Planner`), and the ring's order carries the decodes
(:class:`~vramshard.runtime.streaming.SlotRing`) on their own stream, beside the copy engine's fills.

:class:`VramCoded` codes a packed host buffer on the GPU and keeps in one VRAM buffer its coded blocks, its
ragged end and the raw bytes of the blocks that overflowed; :meth:`VramCoded.decode` rebuilds the packed
bytes on the current stream.
"""

from __future__ import annotations

import torch

from ..env import switch
from .wire_codec import BLOCK_BYTES, CODED_BLOCK, MOST_OVERFLOW, CodedBuffer, code_blocks, decode_into

ALLOCATION = 2 * 2**20  # the caching allocator rounds large blocks to this


def enabled() -> bool:
    """``$VRAMSHARD_VRAM_CODEC``: let the planner keep pinned bf16 weights coded in VRAM (off unless set on)."""
    return switch("VRAMSHARD_VRAM_CODEC", False)


def codes(dtype: torch.dtype, on: bool | None = None) -> bool:
    """Whether pinned weights of ``dtype`` may be kept coded: bf16 with the switch on (``on``; None:
    :func:`enabled`)."""
    return (enabled() if on is None else on) and dtype == torch.bfloat16


def most_overflow_blocks(raw_bytes: int) -> int:
    """The most blocks of ``raw_bytes`` that may overflow (kept raw) in a coded sub-layer."""
    return int(raw_bytes // BLOCK_BYTES * MOST_OVERFLOW)


def vram_bytes(raw_bytes: int) -> int:
    """The most VRAM a sub-layer of ``raw_bytes`` packed bytes takes kept coded: its coded blocks, its ragged
    end and room for :data:`~vramshard.runtime.wire_codec.MOST_OVERFLOW` of its blocks raw, in one buffer."""
    blocks = raw_bytes // BLOCK_BYTES
    nbytes = blocks * CODED_BLOCK + (raw_bytes - blocks * BLOCK_BYTES) + most_overflow_blocks(raw_bytes) * BLOCK_BYTES
    return -(-nbytes // ALLOCATION) * ALLOCATION


class CodingError(ValueError):
    """A buffer whose blocks overflow too often to be kept coded (not bf16 weights)."""


class VramCoded:
    """The packed host buffer ``raw`` (uint8) coded on ``device`` and kept there.

    One buffer holds the coded blocks and the ragged end raw; another the raw bytes of each overflowed block
    (none in bf16 weights: the fiftieth GPU session's random ones, normal and heavy-tailed). Raises
    :class:`CodingError` where more than ``MOST_OVERFLOW`` of the blocks overflow.
    """

    def __init__(self, raw: torch.Tensor, device: torch.device | str, host: CodedBuffer | None = None):
        """``host``: the coded blocks of ``raw`` already made in host memory (the link codec's), copied in
        rather than coded again: a switch of plans that codes pins again then takes a copy, not a coding."""
        if raw.dtype != torch.uint8 or raw.dim() != 1 or raw.numel() % 2:
            raise ValueError("a coded sub-layer needs a 1-D uint8 buffer of 16-bit words")
        self.nbytes = raw.numel()
        self.blocks = self.nbytes // BLOCK_BYTES
        coded_end = self.blocks * CODED_BLOCK
        self.tail = self.nbytes - self.blocks * BLOCK_BYTES
        # The coded blocks and the ragged end in one buffer; the raw bytes of overflowed blocks (rare) apart.
        self.buffer = torch.empty(coded_end + self.tail, dtype=torch.uint8, device=device)
        self.coded = self.buffer[:coded_end]
        self.copied = host is not None and host.coded is not None and host.raw.data_ptr() == raw.data_ptr() \
            and host.raw.numel() == self.nbytes
        if self.copied:
            self.coded.copy_(host.coded, non_blocking=True)
            overflow = list(host.overflow) if len(host.overflow) <= most_overflow_blocks(self.nbytes) else None
        else:
            overflow = code_blocks(raw, self.coded, device, most_overflow_blocks(self.nbytes))
        if overflow is None:
            raise CodingError(f"over {most_overflow_blocks(self.nbytes)} of {self.blocks} blocks overflowed: "
                              "not bf16 weights")
        self.rest = self.buffer[coded_end:]
        if self.tail:
            self.rest.copy_(raw[self.blocks * BLOCK_BYTES :], non_blocking=True)
        self.overflow = self.patches = None
        if overflow:
            self.overflow = torch.tensor(overflow, dtype=torch.int64, device=device)
            self.patches = torch.stack([raw[b * BLOCK_BYTES : (b + 1) * BLOCK_BYTES] for b in overflow]).to(device)

    @property
    def vram_bytes(self) -> int:
        """VRAM this coded sub-layer holds."""
        return self.buffer.numel() + (self.patches.numel() if self.patches is not None else 0)

    def decode(self, target: torch.Tensor) -> None:
        """The packed bytes into ``target`` (uint8, ``nbytes``, on the device) on the current stream."""
        whole = self.blocks * BLOCK_BYTES
        if self.blocks:
            decode_into(self.coded, target[:whole].view(torch.int16))
        if self.tail:
            target[whole : self.nbytes].copy_(self.rest)
        if self.overflow is not None:
            target[:whole].view(self.blocks, BLOCK_BYTES).index_copy_(0, self.overflow, self.patches)
