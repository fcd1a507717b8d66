"""GPU attention over a KV cache that lives in host memory, staged through a small VRAM cache.

When the KV cache stays in host memory (small VRAM budgets: decode is faster with attention on
the CPU), prompt chunks would still run their attention projections on the CPU, where they are
compute-bound. :class:`KVStaging` lets such a layer compute on the GPU instead, for one step:

1. copy in: the blocks holding the step's sequences' cached prefix go host → VRAM (gathered
   into a pinned buffer first, in the staging cache's order, then one copy on the copy stream; the layers take
   :data:`KV_IN_BUFFERS` pinned buffers in turn, so the host gathers the next layer's prefix
   while the copy engine reads this one's; a host cache in page-locked memory whose prefixes lie in
   long runs of consecutive blocks is copied in place instead, a copy a run);
2. the ordinary attention runs over the staging cache, through a :class:`Step` whose block
   tables point there (it writes the new keys and values into the staging cache too);
3. write-back: only the new positions go VRAM → host (copy stream, into a pinned buffer),
   and are scattered into the host cache once the copy is done: when the pinned buffer is
   needed again, before the host cache of that layer is read again, and at :meth:`finish`
   (the executor calls it at the end of every step, so the next step, which may run that
   layer's attention on the CPU, sees a complete cache).

One staging cache serves every staged layer in turn: each sequence gets consecutive staging
blocks (a single sequence's attention then reads a view, no gather). Copies on the copy stream
run in order, so the copy in of layer L+1 cannot overwrite the staging cache before the
write-back of layer L has read it; the write-back itself waits for layer L's attention.

Device-agnostic: with ``device`` the CPU (tests) every copy is immediate and no stream is used.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..errors import BudgetError
from ..layers.step import Step
from .kv_cache import LayerCache

# Pinned buffers the host gathers a layer's cached prefix into, used in turn: the host gathers layer L+1's while the
# copy engine still reads layer L's (with one, each gather waited for the copy before it: session 63).
KV_IN_BUFFERS = 2
# A host cache in page-locked memory is copied in place, a copy a run of consecutive blocks, where its runs average
# at least this many blocks: a copy's issue (~13 us on an H100 host, fifty-seventh GPU session: 162 ms over 24657
# `cudaMemcpyAsync`s) against gathering 16 blocks of an 8B model's keys and values (1 MiB at ~40 GB/s, ~26 us).
DIRECT_RUN_BLOCKS = 16


@dataclass
class _Plan:
    """Where the step's sequences lie in the staging cache, and what to copy (same for every layer)."""

    step: Step  # the step, with block tables into the staging cache
    cache: LayerCache  # the staging cache viewed in the host cache's block size
    # The host block to copy into each staging block from the first up to the last that holds a cached prefix
    # [P] int64 (CPU): the prefixes' blocks where they go, and between them (the blocks the new tokens take, which
    # the attention writes after the copy) the next prefix's first block: one gather and one copy serve every
    # sequence, not one copy each.
    prefix_index: torch.Tensor
    new_rows: torch.Tensor  # flat staging row of every new token, in token order [T] int64 (on the staging device)
    write_index: torch.Tensor  # flat host row of every new token [T] int64 (CPU)
    # The prefixes as runs of consecutive host blocks: (first host block, first staging block, blocks), for a host
    # cache the copy engine reads in place.
    prefix_runs: list[tuple[int, int, int]]

    @property
    def prefix_blocks(self) -> int:
        return self.prefix_index.numel()


@dataclass
class _WriteBack:
    done: object  # torch.cuda.Event, or None when the copy was immediate
    host: LayerCache
    index: torch.Tensor  # [T] flat host rows
    k: torch.Tensor  # [T, Hkv, D] new keys (pinned host buffer)
    v: torch.Tensor


class KVStaging:
    """A VRAM staging cache of ``positions`` positions for GPU attention over host KV caches.

    device: where the staging cache lives (the GPU; the CPU stands in for it in tests).
    copy_stream: the stream for both copies (None: the current stream; ignored on the CPU).
    buffers: pinned write-back buffers, used in turn (a write-back is scattered into the host
    cache when its buffer comes round again, so up to ``buffers`` copies are in flight).
    in_place: whether the copy engine may read the host caches in place (None: where they are page-locked;
    tests on the CPU say True).
    """

    def __init__(self, positions: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, copy_stream=None, buffers: int = 2, in_place: bool | None = None):
        self.in_place = in_place
        self.device = torch.device(device)
        self.on_gpu = self.device.type == "cuda"
        self.copy_stream = copy_stream if self.on_gpu else None
        self.positions = positions
        self.kv_heads, self.head_dim, self.dtype = kv_heads, head_dim, dtype
        # Zeros, not empty: rows beyond a sequence's length are masked, but 0 * NaN is still NaN.
        self.k = torch.zeros(positions, kv_heads, head_dim, dtype=dtype, device=self.device)  # [N, Hkv, D]
        self.v = torch.zeros(positions, kv_heads, head_dim, dtype=dtype, device=self.device)
        # Pinned prefix buffers [rows, Hkv, D] (keys, values), used in turn, and for each the event of the copy in
        # that read it last.
        self._in: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * KV_IN_BUFFERS
        self._in_done: list = [None] * KV_IN_BUFFERS
        self._next_in = 0
        self._out_done = None  # event: the last write-back has read the staging cache
        self._out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * max(1, buffers)
        self._out_owner: list[_WriteBack | None] = [None] * max(1, buffers)
        self._next_out = 0
        self._pending: list[_WriteBack] = []
        self.bytes_in = 0  # bytes copied host -> staging, since the last reset_counters()
        self.bytes_out = 0  # bytes copied staging -> host

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def reset_counters(self) -> None:
        self.bytes_in = self.bytes_out = 0

    # ------------------------------------------------------------------ one layer
    def run(self, sublayer, weights, x: torch.Tensor, step: Step) -> torch.Tensor:
        """``sublayer.forward(weights, x, step)`` with its layer's host KV cache staged through VRAM.

        The host cache is ``step.kv(sublayer.layer)``; ``x`` and ``weights`` are on the staging
        device. Returns the sub-layer's output (the new keys and values reach the host cache by
        :meth:`finish` at the latest)."""
        host = step.kv(sublayer.layer)
        plan = step.memo(("kv_staging", id(self), host.block_size, host.blocks_per_slot), None,
                         lambda: self._plan(step, host))
        self._drain(host)  # a write-back still in flight to this cache must land before it is read
        self._copy_in(plan, host)
        out = sublayer.forward(weights, x, plan.step)
        self._write_back(plan, host)
        return out

    def finish(self) -> None:
        """Wait for every write-back in flight and scatter it into its host cache (end of a step)."""
        for entry in list(self._pending):
            self._land(entry)

    # ------------------------------------------------------------------ the step's layout
    def _plan(self, step: Step, host: LayerCache) -> _Plan:
        size = host.block_size
        blocks = self.positions // size
        tables = step.block_tables if step.block_tables is not None else \
            [range(slot * host.blocks_per_slot, (slot + 1) * host.blocks_per_slot) for slot in step.slots]
        staged_tables, prefix, new_rows, write_index, runs = [], [], [], [], []
        first_block = 0
        for table, start, n in zip(tables, step.starts, step.lengths):
            used = -(-(start + n) // size)
            if len(table) < used:
                raise ValueError(f"a block table of {len(table)} blocks does not cover the {start + n} positions "
                                 "of its sequence")
            cached = -(-start // size)  # blocks holding the prefix (the last one may be partial)
            if cached:
                prefix += [table[0]] * (first_block - len(prefix))  # blocks before it that hold no prefix
                prefix += list(table[:cached])
                for i in range(cached):
                    if i and table[i] == table[i - 1] + 1:
                        host_block, staging_block, count = runs[-1]
                        runs[-1] = (host_block, staging_block, count + 1)
                    else:
                        runs.append((table[i], first_block + i, 1))
            new_rows += range(first_block * size + start, first_block * size + start + n)
            write_index += [table[p // size] * size + p % size for p in range(start, start + n)]
            staged_tables.append(list(range(first_block, first_block + used)))
            first_block += used
        if first_block > blocks:
            raise BudgetError(
                f"this step's sequences need {first_block * size} positions of KV staging, but the staging cache "
                f"holds {blocks * size} (sized for the KV cache planned at load); load with a larger max_context "
                "or run fewer sequences per step")
        view = LayerCache(self.k[: blocks * size].view(blocks, size, self.kv_heads, self.head_dim),
                          self.v[: blocks * size].view(blocks, size, self.kv_heads, self.head_dim),
                          size, blocks)
        staged = dataclasses.replace(step, kv_lookup=lambda layer: view, block_tables=staged_tables, _memo={})
        return _Plan(staged, view, torch.tensor(prefix, dtype=torch.long),
                     torch.tensor(new_rows, dtype=torch.long).to(self.device),
                     torch.tensor(write_index, dtype=torch.long), runs)

    # ------------------------------------------------------------------ copies
    def _copy_in(self, plan: _Plan, host: LayerCache) -> None:
        """The prefix blocks of the step's sequences: host cache → pinned buffer → staging cache."""
        if not plan.prefix_blocks:
            if self._out_done is not None:
                # The attention is about to write new keys into rows the last write-back may still read.
                torch.cuda.current_stream(self.device).wait_event(self._out_done)
            return
        in_place = host.k.is_pinned() if self.in_place is None else self.in_place
        if in_place and len(plan.prefix_runs) * DIRECT_RUN_BLOCKS <= plan.prefix_blocks:
            self._copy_in_place(plan, host)
            return
        size = host.block_size
        rows = plan.prefix_blocks * size
        turn = self._next_in
        self._next_in = (turn + 1) % KV_IN_BUFFERS
        if self._in_done[turn] is not None:
            self._in_done[turn].synchronize()  # the copy in that last used these pinned buffers has read them
        in_k, in_v = self._in[turn] = self._host_buffers(None, rows, self._in[turn])
        staging_k, staging_v = plan.cache.k, plan.cache.v  # [blocks, size, Hkv, D]
        shape = (plan.prefix_blocks, size, self.kv_heads, self.head_dim)
        src_k, src_v = in_k[:rows].view(shape), in_v[:rows].view(shape)
        torch.index_select(host.k, 0, plan.prefix_index, out=src_k)
        torch.index_select(host.v, 0, plan.prefix_index, out=src_v)
        with self._on_copy_stream():  # one copy each: the blocks between the prefixes come along
            staging_k[: plan.prefix_blocks].copy_(src_k, non_blocking=True)
            staging_v[: plan.prefix_blocks].copy_(src_v, non_blocking=True)
            done = self._in_done[turn] = self._record()
        if self.on_gpu:
            torch.cuda.current_stream(self.device).wait_event(done)  # attention after the copy in
        self.bytes_in += 2 * src_k.nbytes

    def _copy_in_place(self, plan: _Plan, host: LayerCache) -> None:
        """The prefix blocks of the step's sequences straight from a page-locked host cache to the staging cache,
        a copy a run of consecutive blocks (no gather on the host). The host cache is not written while they read
        it: a layer's write-backs land before its next copy in, and the step ends after its copies."""
        staging_k, staging_v = plan.cache.k, plan.cache.v  # [blocks, size, Hkv, D]
        with self._on_copy_stream():
            for host_block, block, count in plan.prefix_runs:
                staging_k[block : block + count].copy_(host.k[host_block : host_block + count], non_blocking=True)
                staging_v[block : block + count].copy_(host.v[host_block : host_block + count], non_blocking=True)
            done = self._record()
        if self.on_gpu:
            torch.cuda.current_stream(self.device).wait_event(done)  # attention after the copy in
        self.bytes_in += 2 * sum(count for _, _, count in plan.prefix_runs) * host.k[0].nbytes

    def _write_back(self, plan: _Plan, host: LayerCache) -> None:
        """The new positions: staging cache → pinned buffer now (after the attention), → host cache later."""
        tokens = plan.step.num_tokens
        slot = self._next_out % len(self._out)
        self._next_out += 1
        owner = self._out_owner[slot]
        if owner is not None:
            self._land(owner)  # the buffer's previous write-back must be scattered before it is reused
        self._out[slot] = self._host_buffers(None, tokens, self._out[slot])
        out_k, out_v = self._out[slot][0][:tokens], self._out[slot][1][:tokens]
        attention_done = self._record() if self.on_gpu else None
        with self._on_copy_stream():
            if attention_done is not None and self.copy_stream is not None:
                self.copy_stream.wait_event(attention_done)
            # The new rows gathered on the device, then one copy each (not one per sequence).
            out_k.copy_(self.k.index_select(0, plan.new_rows), non_blocking=True)
            out_v.copy_(self.v.index_select(0, plan.new_rows), non_blocking=True)
            done = self._out_done = self._record()
        entry = _WriteBack(done, host, plan.write_index, out_k, out_v)
        self._out_owner[slot] = entry
        self._pending.append(entry)
        self.bytes_out += out_k.nbytes + out_v.nbytes
        if not self.on_gpu:
            self._land(entry)

    def _land(self, entry: _WriteBack) -> None:
        """Wait for a write-back's copy and scatter its rows into the host cache."""
        if entry not in self._pending:
            return
        if entry.done is not None:
            entry.done.synchronize()
        flat_k = entry.host.k.view(-1, self.kv_heads, self.head_dim)  # [blocks * size, Hkv, D]
        flat_v = entry.host.v.view(-1, self.kv_heads, self.head_dim)
        flat_k.index_copy_(0, entry.index, entry.k)
        flat_v.index_copy_(0, entry.index, entry.v)
        self._pending.remove(entry)
        for i, owner in enumerate(self._out_owner):
            if owner is entry:
                self._out_owner[i] = None

    def _drain(self, host: LayerCache) -> None:
        for entry in [e for e in self._pending if e.host is host]:
            self._land(entry)

    # ------------------------------------------------------------------ helpers
    def _host_buffers(self, attr: str | None, rows: int, current=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Pinned host buffers [>= rows, Hkv, D] for keys and values, grown (to a power of two) when short."""
        buffers = getattr(self, attr) if attr else current
        if buffers is None or buffers[0].shape[0] < rows:
            size = 1 << max(rows - 1, 1).bit_length()
            shape = (size, self.kv_heads, self.head_dim)
            buffers = (torch.empty(shape, dtype=self.dtype, pin_memory=self.on_gpu),
                       torch.empty(shape, dtype=self.dtype, pin_memory=self.on_gpu))
            if attr:
                setattr(self, attr, buffers)
        return buffers

    def _on_copy_stream(self):
        if self.copy_stream is None:
            return _NoStream()
        return torch.cuda.stream(self.copy_stream)

    def _record(self):
        if not self.on_gpu:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event


class _NoStream:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
