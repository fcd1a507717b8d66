"""The paged KV cache: per attention layer, a pool of fixed-size blocks of positions.

Every layer's keys and values live in ``num_blocks`` blocks of ``block_size`` positions
([num_blocks, block_size, kv_heads, head_dim]). A sequence owns a *block table*, the list of
its blocks in position order: position p lives at block ``table[p // block_size]``, offset
``p % block_size``. Tables are the same for every layer, so one :class:`BlockAllocator` per
cache hands blocks out, on demand as sequences grow, and takes them back when they end.

No sequence can be stranded half-way: a sequence *reserves* the blocks it may ever need
(prompt plus answer) when it is admitted, and only then takes physical blocks as it grows.
When the unreserved blocks run out, a new sequence waits; a running one never loses its cache.

Prefix caching: a full block whose keys and values a sequence has written can be registered
under its contents (the token ids of every position up to its end, :func:`prefix_keys`). A later
sequence whose prompt starts with the same tokens takes those blocks into its table instead of
computing them again (blocks shared by several sequences are only read: a sequence writes from
its first uncached position on, always in a block of its own). A registered block nobody holds
stays cached until a growing sequence needs a block and none is free: the least recently
released goes first. Reservations count shared blocks in full for every sequence holding them,
so sharing saves compute, never the no-stranding guarantee.

Callers that never pass block tables (``Step.block_tables`` None) see the old row layout:
slot s owns blocks ``s * blocks_per_slot ...``, contiguous, so a single sequence reads a view.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable

import torch

DEFAULT_BLOCK_SIZE = 16  # positions per block; the most a sequence wastes is one block less one


@dataclass
class LayerCache:
    """Keys and values of one attention layer, in blocks."""

    k: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]
    v: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]
    block_size: int
    blocks_per_slot: int  # row layout for steps without block tables: slot s starts at block s * this

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @property
    def num_blocks(self) -> int:
        return self.k.shape[0]


def prefix_keys(tokens: Sequence[int], block_size: int) -> list[tuple]:
    """The content key of each full block of ``tokens``: block i's key holds the token ids of
    positions ``0 .. (i + 1) * block_size - 1`` (a chain of (parent key, this block's ids), so
    equal keys mean equal prefixes; dict lookups compare them in full, no hash is trusted alone)."""
    keys, parent = [], None
    for begin in range(0, len(tokens) - block_size + 1, block_size):
        parent = (parent, tuple(tokens[begin : begin + block_size]))
        keys.append(parent)
    return keys


class BlockAllocator:
    """Hands out the blocks of a pool to sequences (keyed by any hashable id).

    :meth:`admit` reserves the blocks a sequence may ever need (and gives it the cached blocks of
    its prefix, :meth:`cached_prefix`); :meth:`grow` gives it physical blocks up to a length (never
    failing within the reservation); :meth:`register` files its full written blocks under their
    contents; :meth:`release` frees the blocks and the reservation (registered blocks stay cached
    until their room is needed). A growing sequence gets the block after its last one when that is
    free, so a sequence that runs alone keeps a contiguous cache (attention then reads a view).

    What the pool has promised (:attr:`committed_blocks`) is the blocks held now, each counted once
    however many sequences share it, plus the blocks each sequence may still take to reach its
    reservation. It never exceeds the pool, so the blocks nobody holds (free or cached) always cover
    every sequence's growth; and sequences that share a prefix are charged for it once.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a block pool needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: set[int] = set(range(num_blocks))
        self._tables: dict[object, list[int]] = {}
        self._reserved: dict[object, int] = {}
        self.reserved_blocks = 0  # the sequences' reservations summed (a shared prefix once per sharer)
        self._to_take = 0  # the blocks sequences may still take: their reservations less their tables
        self._holders: dict[int, int] = {}  # block -> sequences holding it (held blocks only)
        self._by_key: dict[tuple, int] = {}  # prefix cache: content key -> block
        self._key_of: dict[int, tuple] = {}  # and back
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds, least recent first

    # ------------------------------------------------------------------ queries
    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` positions."""
        return -(-tokens // self.block_size)

    @property
    def free_blocks(self) -> int:
        """Blocks nobody holds now (cached ones among them: they give way when needed)."""
        return len(self._free) + len(self._idle)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - self.free_blocks

    @property
    def cached_blocks(self) -> int:
        """Blocks filed in the prefix cache (held or not)."""
        return len(self._key_of)

    @property
    def committed_blocks(self) -> int:
        """The blocks held now (a shared one once) and those sequences may still take."""
        return len(self._holders) + self._to_take

    @property
    def unreserved_blocks(self) -> int:
        """Blocks a new sequence may still reserve."""
        return self.num_blocks - self.committed_blocks

    def charge(self, tokens: int, prefix: Sequence[int] = ()) -> int:
        """The blocks admitting a sequence of ``tokens`` positions with the cached blocks ``prefix``
        commits: the blocks it will take, and the prefix blocks no other sequence holds."""
        return self.blocks_for(tokens) - len(prefix) + sum(block not in self._holders for block in prefix)

    def can_admit(self, tokens: int, prefix: Sequence[int] = ()) -> bool:
        return self.charge(tokens, prefix) <= self.unreserved_blocks

    def table(self, seq) -> list[int]:
        """The block table of ``seq`` (its blocks in position order); the live list, do not change it."""
        return self._tables[seq]

    def __contains__(self, seq) -> bool:
        return seq in self._tables

    def cached_prefix(self, keys: Sequence[tuple]) -> list[int]:
        """The cached blocks of the longest run of ``keys`` (from :func:`prefix_keys`) from the start."""
        blocks = []
        for key in keys:
            block = self._by_key.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    # ------------------------------------------------------------------ changes
    def admit(self, seq, tokens: int, prefix: Sequence[int] = ()) -> None:
        """Reserve room for ``tokens`` positions of a new sequence; its table starts with the cached
        blocks ``prefix`` (:meth:`cached_prefix`), which it then shares, and has no other block yet."""
        if seq in self._tables:
            raise ValueError(f"sequence {seq!r} already holds blocks")
        need = self.blocks_for(tokens)
        if len(prefix) > need or any(block not in self._key_of for block in prefix):
            raise ValueError(f"sequence {seq!r}: a prefix of {len(prefix)} blocks that are not all cached, or "
                             f"more than the {need} it reserves")
        if self.charge(tokens, prefix) > self.unreserved_blocks:
            raise ValueError(f"sequence {seq!r} needs {self.charge(tokens, prefix)} more blocks, only "
                             f"{self.unreserved_blocks} are unreserved")
        self._tables[seq] = list(prefix)
        for block in prefix:
            self._holders[block] = self._holders.get(block, 0) + 1
            self._idle.pop(block, None)
        self._reserved[seq] = need
        self.reserved_blocks += need
        self._to_take += need - len(prefix)

    def grow(self, seq, tokens: int) -> list[int]:
        """Make the table of ``seq`` cover ``tokens`` positions; returns the table."""
        table = self._tables[seq]
        need = self.blocks_for(tokens)
        if need > self._reserved[seq]:
            raise ValueError(f"sequence {seq!r} grows to {tokens} positions, beyond the "
                             f"{self._reserved[seq] * self.block_size} it reserved")
        while len(table) < need:
            block = self._take(table[-1] + 1 if table else None)
            self._holders[block] = 1
            table.append(block)
            self._to_take -= 1
        return table

    def register(self, seq, keys: Sequence[tuple]) -> None:
        """File the first ``len(keys)`` blocks of ``seq`` under their content keys (their keys and
        values written: the caller's promise). A key already filed keeps its block."""
        for block, key in zip(self._tables[seq], keys):
            if key not in self._by_key and block not in self._key_of:
                self._by_key[key] = block
                self._key_of[block] = key

    def release(self, seq) -> None:
        """Give back the blocks and the reservation of ``seq`` (a no-op for an unknown one)."""
        table = self._tables.pop(seq, None)
        if table is None:
            return
        self._to_take -= self._reserved[seq] - len(table)
        for block in table:
            left = self._holders.pop(block) - 1
            if left:
                self._holders[block] = left
            elif block in self._key_of:
                self._idle[block] = None  # cached, most recently released last
            else:
                self._free.add(block)
        self.reserved_blocks -= self._reserved.pop(seq)

    def forget_cached(self) -> None:
        """Empty the prefix cache (blocks nobody holds become free)."""
        self._free.update(self._idle)
        self._idle.clear()
        self._by_key.clear()
        self._key_of.clear()

    def _take(self, after: int | None) -> int:
        """A block for a growing sequence: ``after`` if free, else the lowest free one, else the least
        recently released cached one (there is one: held blocks never exceed the reservations)."""
        if after in self._free:
            self._free.remove(after)
            return after
        if self._free:
            block = min(self._free)
            self._free.remove(block)
            return block
        block, _ = self._idle.popitem(last=False)
        del self._by_key[self._key_of.pop(block)]
        return block


class KVCache:
    """Caches for the given attention layers, each on the device ``device_of(layer)`` says.

    Sized as ``slots`` rows of ``max_ctx`` positions (rounded up to whole blocks): the pool
    holds ``slots * ceil(max_ctx / block_size)`` blocks. Use it either through block tables
    from :attr:`allocator` (paged: sequences of any length share the pool) or, without block
    tables, as ``slots`` rows (see the module docstring).
    """

    def __init__(self, layers: list[int], slots: int, max_ctx: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device_of: Callable[[int], torch.device | str],
                 block_size: int = DEFAULT_BLOCK_SIZE, pin_host: bool = False):
        self.slots, self.max_ctx, self.block_size = slots, max_ctx, block_size
        self.blocks_per_slot = math.ceil(max_ctx / block_size)
        self.num_blocks = slots * self.blocks_per_slot
        # Host layers in page-locked memory (an engine that stages them through VRAM: the copy engine then reads
        # them in place, no gather into a pinned buffer first; where pinning fails, pageable memory).
        self.pin_host = pin_host
        shape = (self.num_blocks, block_size, kv_heads, head_dim)
        self._layers = {
            layer: LayerCache(self._zeros(shape, dtype, device_of(layer)), self._zeros(shape, dtype, device_of(layer)),
                              block_size, self.blocks_per_slot)
            for layer in layers
        }
        self.allocator = BlockAllocator(self.num_blocks, block_size)

    def _zeros(self, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
        """Zeros, not empty: padded key rows of a batch are masked, but 0 * NaN would still be NaN. On the host
        page-locked where :attr:`pin_host`."""
        device = torch.device(device)
        if device.type == "cpu" and self.pin_host:
            from .pinned_host import pinned_exact_or_pageable

            return pinned_exact_or_pageable(math.prod(shape) * dtype.itemsize).view(dtype).view(shape).zero_()
        return torch.zeros(shape, dtype=dtype, device=device)

    def __call__(self, layer: int) -> LayerCache:
        return self._layers[layer]

    @property
    def num_tokens(self) -> int:
        """Positions in the pool."""
        return self.num_blocks * self.block_size

    def slot_rows(self, layer: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``slot`` in the row layout (no block tables): views [rows, Hkv, D]."""
        cache = self._layers[layer]
        rows = self.blocks_per_slot * self.block_size
        k = cache.k.view(-1, *cache.k.shape[2:])
        v = cache.v.view(-1, *cache.v.shape[2:])
        return k[slot * rows : (slot + 1) * rows], v[slot * rows : (slot + 1) * rows]

    @torch.inference_mode()
    def fill_random(self, context: int, std: float = 1.0) -> None:
        """Benchmarks: random keys and values at positions 0 .. context - 1 of every slot (row layout),
        as if each slot had ``context`` tokens cached."""
        for layer in self._layers:
            for slot in range(self.slots):
                k, v = self.slot_rows(layer, slot)
                k[:context].normal_(0, std)
                v[:context].normal_(0, std)

    @property
    def layers(self) -> list[int]:
        """The attention layers this cache holds."""
        return list(self._layers)

    def device_of(self, layer: int) -> torch.device:
        """Where the keys and values of ``layer`` live now."""
        return self._layers[layer].k.device

    @torch.inference_mode()
    def move_layers(self, layers, device: torch.device | str) -> int:
        """Move the keys and values of ``layers`` to ``device`` (a running engine whose VRAM budget
        changed). Content, block tables and the allocator stay as they are: sequences go on where they
        were. Not during a forward step (the executor calls it under its lock). Returns bytes moved."""
        device = torch.device(device)
        moved = 0
        for layer in layers:
            cache = self._layers[layer]
            if _same_device(cache.k.device, device):
                continue
            # One layer at a time, the old copy dropped at once: moving out of VRAM never needs
            # room for a second copy of the whole cache there.
            if device.type == "cpu" and self.pin_host:
                cache.k = self._zeros(tuple(cache.k.shape), cache.k.dtype, device).copy_(cache.k)
                cache.v = self._zeros(tuple(cache.v.shape), cache.v.dtype, device).copy_(cache.v)
            else:
                cache.k = cache.k.to(device)
                cache.v = cache.v.to(device)
            moved += cache.nbytes
        return moved

    def tensors(self, layers) -> list[torch.Tensor]:
        """The keys and values of those of ``layers`` this cache holds, as they lie now."""
        return [t for layer in layers if layer in self._layers for t in (self._layers[layer].k, self._layers[layer].v)]

    def bytes_on(self, device_type: str) -> int:
        return sum(c.nbytes for c in self._layers.values() if c.k.device.type == device_type)

    @staticmethod
    def bytes_needed(num_layers: int, slots: int, max_ctx: int, kv_heads: int, head_dim: int,
                     dtype: torch.dtype, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
        positions = slots * math.ceil(max_ctx / block_size) * block_size
        return 2 * num_layers * positions * kv_heads * head_dim * dtype.itemsize


def _same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` are one device when the current device is 0."""
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index == b.index:
        return True
    current = torch.cuda.current_device()
    return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)
