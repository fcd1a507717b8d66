"""The executor's dense FFNs split between the CPU and the GPU (a mixin of :class:`~.executor.Executor`).

A split FFN (``Where.cpu_pieces``) streams only its GPU part (its last pieces) through the ring;
the step queues that part on the compute stream, computes the first pieces on the CPU meanwhile (on
the host thread or the run-ahead worker: at up to four rows by the C kernel from the plain weights,
:mod:`~vramshard.layers.cpu_gemv`; else from prepacked weights, :mod:`~vramshard.runtime.cpu_packed`,
or with a row-major copy of their down projection, :mod:`~vramshard.runtime.cpu_down`), and adds the
two where the FFN's input lives: the normalized activation crosses to the other device once and its contribution comes back once. The state
(``ring``, ``host``, ``_down_copies``, ``_packed``, ``_ffn_buffers`` ...) is the executor's own.
"""

from __future__ import annotations

import time

import torch

from ..errors import InvalidInputError
from ..layers import cpu_gemv
from ..layers.mlp import DenseFFN
from ..plan.placement import TieredPlacement
from . import cpu_packed, run_ahead
from .cpu_packed import DECODE_ROWS
from .ffn_buffers import FFNBuffers


class FFNSplitSteps:
    """Dense FFNs split between the CPU and the GPU: checking the splits and running their steps."""

    def _cpu_ffn_parts(self, plans: TieredPlacement) -> set[tuple[str, int]]:
        """(dense FFN, pieces on the CPU) of every CPU part the plans compute: split FFNs' first
        pieces, and FFNs on the CPU whole."""
        parts = set()
        for placement in plans.placements:
            for name, where in placement.as_dict().items():
                sublayer = self.model[name]
                if not isinstance(sublayer, DenseFFN):
                    continue
                if where.cpu_pieces:
                    parts.add((name, where.cpu_pieces))
                elif where.compute == "cpu":
                    parts.add((name, sublayer.num_pieces))
        return parts

    def _prepare_cpu_parts(self, plans: TieredPlacement) -> None:
        """Make the copies the CPU parts of the first tier and of the decode-sized tiers read now (at
        load, or when the plans change), not in a tier's first step: prepacked parts where the tier
        packs (:mod:`.cpu_packed`), else the row-major down copy (:mod:`.cpu_down`) of each FFN such a
        tier computes from the plain weights above the C kernel's rows (one copy per FFN, as wide as its
        widest part in any tier: prompt chunks read it too). Made in the first step instead, packing
        stalled nemo-8b's first decode steps at 8 GiB for about 6 s and its first 16-token step for
        1.4 s on the H100 machine, and the down copies llama3-8b's first 16-row step for up to 2 s (the
        thirty-first and thirty-second GPU sessions, docs/BENCHMARKS.md): the tiers of 5 to 64 rows run
        short prompts as well as batches, so a chat meets them in its first message. A prompt chunk
        beside packed decode tiers makes its down copies in its first step (the library's transpose: a
        few ms a part)."""
        for name, pieces, views, rows, packs in self._parts_read_first(plans):
            if not (packs and self._packed.enabled) or self._packed.get(name, pieces, views, rows) is None:
                self._down_copies.part(name, pieces, views)

    def prepare(self, plans: TieredPlacement) -> None:
        """Make the copies that ``plans``, not yet in force, will read, off the steps: the parts their first
        steps read packed (as :meth:`_prepare_cpu_parts` packs them at the switch), and the row-major down
        copies their steps read otherwise (prompt chunks, tiers that do not pack; made at the switch or in a
        tier's first step before). The budget follower calls it on its background thread once a re-plan is
        made, while the steps go on under the plans in force, so that the switch (:meth:`reconfigure`, under
        the executor's lock) and the first steps after it find them made (``cpu_packed.PACK_AHEAD``). The
        kernels are still compiled at the switch."""
        if not cpu_packed.PACK_AHEAD:
            return
        if self._packed.enabled:
            parts = [(name, pieces, views, rows)
                     for name, pieces, views, rows, packs in self._parts_read_first(plans) if packs]
            self._packed.expect((name, pieces) for name, pieces, _, _ in parts)
            for name, pieces, views, rows in parts:
                self._packed.pack_ahead(name, pieces, views, rows)
        self._down_copies.stage(self._cpu_ffn_parts(plans), self._ffns_read_through_copies(plans))

    def _ffns_read_through_copies(self, plans: TieredPlacement) -> set[str]:
        """The dense FFNs whose CPU part some tier of ``plans`` computes from the plain weights with a
        row-major down copy: above the C kernel's rows, in prompt chunks or at a tier that does not pack."""
        names = set()
        for tier, placement in zip(plans.tiers, plans.placements):
            if cpu_gemv.computes(tier) or (tier <= DECODE_ROWS and self._packed.enabled and self._packs(plans, tier)):
                continue
            names.update(name for name, where in placement.as_dict().items()
                         if isinstance(self.model[name], DenseFFN) and (where.cpu_pieces or where.compute == "cpu"))
        return names

    def _packs(self, plans: TieredPlacement, rows: int) -> bool:
        """Whether ``plans`` pack dense FFN work of ``rows`` rows on the CPU (none that the C kernel's matrix tiles
        compute: :func:`~vramshard.layers.cpu_gemv.amx_computes`)."""
        return plans.packs(rows) and not cpu_gemv.amx_computes(rows, self.model.dtype)

    def _parts_read_first(self, plans: TieredPlacement):
        """(FFN name, pieces on the CPU, the part's views, rows, whether its tier packs) of each CPU part
        of a dense FFN that ``plans``' first tier and decode-sized tiers compute above the C kernel's rows."""
        for index, (tier, placement) in enumerate(zip(plans.tiers, plans.placements)):
            if cpu_gemv.computes(tier) or (index > 0 and tier > DECODE_ROWS):
                continue  # parts of a few rows read the plain weights as they lie; prompt chunks copy in theirs
            rows = tier if tier <= DECODE_ROWS else 1  # (a single plan for every step size: as one-row steps)
            packs = self._packs(plans, rows)
            for name, where in placement.as_dict().items():
                sublayer = self.model[name]
                if not isinstance(sublayer, DenseFFN) or not (where.cpu_pieces or where.compute == "cpu"):
                    continue
                pieces = where.cpu_pieces or sublayer.num_pieces
                views = self._cpu_part(sublayer, pieces) if where.cpu_pieces else self.host[name].views
                yield name, pieces, views, rows, packs

    def _check_ffn_splits(self, plans: TieredPlacement) -> None:
        """Split FFNs are dense FFNs packed in pieces, with 1 <= cpu_pieces < their pieces."""
        for p in plans.placements:
            for name in p.split_names():
                sublayer, k = self.model[name], p[name].cpu_pieces
                if not isinstance(sublayer, DenseFFN):
                    raise InvalidInputError(f"placement {p.name} splits {name} between the CPU and the GPU, but only "
                                            "dense FFN sub-layers split into pieces")
                if not k < sublayer.num_pieces:
                    raise InvalidInputError(f"placement {p.name} puts {k} pieces of {name} on the CPU, but it has "
                                            f"{sublayer.num_pieces}; use fewer, or place it on the CPU whole")
                if not self.host[name].layout.splittable:
                    raise InvalidInputError(f"placement {p.name} splits {name}, but its host weights were not packed "
                                            "in pieces; pack them with pack_model (dense FFNs are split-ready)")

    def _run_ffn_split(self, sublayer: DenseFFN, cpu_pieces: int, x: torch.Tensor,
                       compute: torch.cuda.Stream) -> tuple[torch.Tensor, int]:
        """A dense FFN split: pieces ``cpu_pieces..P-1`` from their stream slot on the GPU, queued first,
        pieces ``0..cpu_pieces-1`` on the CPU from host memory meanwhile; the output is ``x`` plus both
        contributions, on ``x``'s device. The normalized activation crosses to the other device once,
        the other device's contribution comes back once. Returns (x, crossings)."""
        host = self.host[sublayer.name].views
        cpu_part = self._cpu_part(sublayer, cpu_pieces)
        gpu_part = self.ring.acquire((sublayer.name, cpu_pieces), compute)
        if x.device.type == "cpu":
            crossed = torch.cuda.Event()
            computing = time.perf_counter()
            h = sublayer.norm(host, x)  # [T, D]
            y_gpu = sublayer.contribution(gpu_part, h.to(self.gpu, non_blocking=True))
            self.ring.release(compute)
            y_back = y_gpu.to("cpu", non_blocking=True)  # lands once the GPU part is done
            crossed.record(compute)
            parting = time.perf_counter()
            y = x + self._cpu_contribution(sublayer, cpu_part, h, cpu_pieces)  # while the GPU computes its part
            waiting = time.perf_counter()
            crossed.synchronize()
            self._host_compute_s += waiting - computing
            self._host_split_s += waiting - parting
            self._host_wait_s += time.perf_counter() - waiting
            return y + y_back, 2
        h = sublayer.norm(gpu_part, x)  # [T, D] on the GPU
        h_host = h.to("cpu", non_blocking=True)  # queued before the GPU part: it does not wait for it
        ahead = self._ahead(dense=True, rows=h.shape[0])
        if ahead is not None:
            number = ahead.copied()  # the worker starts once h_host has landed
            y = x + sublayer.contribution(gpu_part, h)
            self.ring.release(compute)
            return y + self._cpu_part_ahead(ahead, number, sublayer, cpu_pieces, cpu_part, h_host), 2
        crossed = torch.cuda.Event()
        crossed.record(compute)
        y = x + sublayer.contribution(gpu_part, h)
        self.ring.release(compute)
        waiting = time.perf_counter()
        crossed.synchronize()
        computing = time.perf_counter()
        y_cpu = self._cpu_contribution(sublayer, cpu_part, h_host, cpu_pieces)
        self._on_host(waiting, computing)
        self._host_split_s += time.perf_counter() - computing
        y_cpu = y_cpu.to(self.gpu, non_blocking=True)
        if FFNBuffers.wanted(h_host.shape[0]):
            self._ffn_buffers.copying()  # the buffer is not reused before this copy is done
        return y + y_cpu, 2

    def _cpu_part_ahead(self, ahead: run_ahead.RunAhead, number: int, sublayer: DenseFFN, cpu_pieces: int,
                        cpu_part: dict[str, torch.Tensor], h_host: torch.Tensor) -> torch.Tensor:
        """A split FFN's CPU part ``number`` on the run-ahead worker, once the activation's copy to
        ``h_host`` has landed; returns its result's copy on the GPU (nothing here waits)."""
        rows = h_host.shape[0]
        if not cpu_gemv.computes(rows):
            tiles = cpu_gemv.amx_computes(rows, h_host.dtype)  # (through the matrix tiles: one call, not packed)
            packed = None if tiles else self._packed.get(sublayer.name, cpu_pieces, cpu_part, rows)  # (on first use)
            if packed is not None:
                return ahead.result_on(self.gpu, number, h_host, lambda out: out.copy_(packed.contribution(h_host)))
            cpu_part = self._down_copies.part(sublayer.name, cpu_pieces, cpu_part)  # (down row-major)
            if FFNBuffers.wanted(rows) and not tiles:
                work = ahead.buffers.work(sublayer.work_elements(cpu_part, rows), h_host.dtype)
                return ahead.result_on(self.gpu, number, h_host,
                                       lambda out: sublayer.contribution_into(cpu_part, h_host, out, work))
        # Few rows: the C kernel up to its rows (one bound call, where it takes the part), else the projections
        # tuned per shape; into the pinned buffer.
        return ahead.result_on(self.gpu, number, h_host, lambda out: out.copy_(sublayer.contribution(cpu_part, h_host)),
                               lambda out: sublayer.contribution_part(cpu_part, h_host, out))

    def _cpu_contribution(self, sublayer: DenseFFN, weights: dict[str, torch.Tensor], h: torch.Tensor,
                          cpu_pieces: int) -> torch.Tensor:
        """The contribution of the FFN's first ``cpu_pieces`` pieces (``weights``: their views, or the
        whole FFN's) for the normalized ``h`` [T, D] on the CPU. At many rows it is computed in, or
        copied into, the reused buffers (:mod:`~vramshard.runtime.ffn_buffers`) and stays valid
        until the next call but one. From prepacked weights where the part is packed
        (:mod:`~vramshard.runtime.cpu_packed`), else from ``weights`` with down row-major where a copy
        is allowed (:mod:`~vramshard.runtime.cpu_down`). Up to four rows, where the C kernel serves
        (:mod:`~vramshard.layers.cpu_gemv`): from ``weights`` as they lie, no copy."""
        rows = h.shape[0]
        if cpu_gemv.computes(rows):
            return sublayer.contribution(weights, h)
        # (rows through the matrix tiles: from the weights with down row-major, not packed)
        packed = None if cpu_gemv.amx_computes(rows, h.dtype) else self._packed.get(sublayer.name, cpu_pieces,
                                                                                    weights, rows)
        if packed is not None:
            y = packed.contribution(h)
            return self._ffn_buffers.result(rows, h.shape[-1], h.dtype).copy_(y) if FFNBuffers.wanted(rows) else y
        weights = self._down_copies.part(sublayer.name, cpu_pieces, weights)  # (not packed: down row-major)
        if not FFNBuffers.wanted(rows):
            return sublayer.contribution(weights, h)
        buffers = self._ffn_buffers
        return sublayer.contribution_into(weights, h, buffers.result(rows, h.shape[-1], h.dtype),
                                          buffers.work(sublayer.work_elements(weights, rows), h.dtype))

    def _simulate_ffn_split(self, sublayer: DenseFFN, cpu_pieces: int, x: torch.Tensor) -> torch.Tensor:
        """The split of a simulated GPU: the GPU part is copied from the host buffer into a CPU
        "slot" by the same ranges the ring copies, and computed from its views there."""
        packed = self.host[sublayer.name]
        part = packed.layout.split_part(cpu_pieces)
        if self._sim_slot is None or self._sim_slot.numel() < part.nbytes:
            self._sim_slot = torch.empty(part.nbytes, dtype=torch.uint8)
        part.fill(self._sim_slot, packed.buffer, non_blocking=False)
        h = sublayer.norm(packed.views, x)
        y_gpu = sublayer.contribution(part.views(self._sim_slot), h)
        return x + self._cpu_contribution(sublayer, self._cpu_part(sublayer, cpu_pieces), h, cpu_pieces) + y_gpu

    def _cpu_part(self, sublayer: DenseFFN, cpu_pieces: int) -> dict[str, torch.Tensor]:
        """The views of a split FFN's first ``cpu_pieces`` pieces in its host buffer (made once). Their
        down projection gets a row-major copy only where the part is computed from them, not packed
        (:meth:`_cpu_contribution`): a packed part is a copy of its own, and a row-major one beside it
        would go unread."""
        cpu_part = self._cpu_parts.get((sublayer.name, cpu_pieces))
        if cpu_part is None:
            cpu_part = self._cpu_parts[sublayer.name, cpu_pieces] = sublayer.pieces_of(
                self.host[sublayer.name].views, 0, cpu_pieces)
        return cpu_part
