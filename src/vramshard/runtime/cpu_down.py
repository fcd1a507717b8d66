"""Row-major copies of the down projections the CPU computes from a splittable FFN (``VRAMSHARD_CPU_DOWN_COPY``).

A dense FFN packed so plans may split it stores ``down_proj`` transposed ([F, D]), so that the GPU
part of a split streams as a few contiguous ranges (:mod:`~vramshard.runtime.host_weights`). The CPU
then reads down as a transposed view ([D, r], its rows strided), and its products read that layout
slowly: on the 2-core development machine (session 28, ``python -m benchmarks.cpu_layouts``) a
llama3-8b quarter part's down of one token took 2.47 ms through ATen from the transposed view, 1.87 ms
from a row-major copy and 0.77 ms as the compiled row sums a row-major copy allows
(:mod:`~vramshard.layers.cpu_swiglu`), its weights' read time being 0.55 ms; at 4, 16 and 64 rows the
copy was 1.55x, 1.38x and 1.16x faster through ATen.

Here the down of an FFN whose CPU part the plans compute from the plain weights (a split FFN's first
pieces, or a whole FFN the CPU computes) gets one row-major copy: of its widest CPU part in the plans in
force, so that the parts of fewer pieces (the plans of other step sizes split it elsewhere) read its
leading columns ([D, r] at the copy's row stride) and no tier's first step waits for a copy of its own.
Those narrower parts' down products may be slower than from a copy of their own width: on the
development machine (2 threads, bf16, three pieces more in the copy) they took 0.91-1.19x as long at 16
and 64 rows (``python -m benchmarks.down_copy``, session 37; 0.99-1.30x in an earlier run), and
down is a third of a part's weights. A copy per width would cost the host memory of one more copy of each
width the plans use, where our users' hosts have 16-64 GiB.

The executor makes the copies when it takes its plans (at load, at a switch), and keeps each while the
plans in force compute that FFN's part on the CPU, replacing it where they want a wider one
(:meth:`DownCopies.keep`). The copy is the C library's tiled transpose on torch's threads
(:func:`~vramshard.layers.cpu_gemv.transpose_into`; torch's copy of the transposed view, where the
library is not built, runs on one thread): on the H100 machine (session 37,
``docs/logs-run37/llama8_call7.log``) torch's copies ran at about 1 GB/s (7-112 MiB in 4.5-116 ms), and
the first 16-row step of llama3-8b at 8 GiB took 1986 ms, when they were made per (FFN, pieces) in each
tier's first step. On the development machine the library's copy took a llama3-8b part (49 MiB) in 24.6
and 18.6 ms on 1 and 2 threads against torch's 41.1 and 41.2, and a plain copy of the same bytes' 11.8 and
6.6 (``python -m benchmarks.down_copy``, session 37).

Since session 48 the copies a re-plan will read are made before its plan comes into force (:meth:`DownCopies.stage`,
on the budget follower's thread, with ``VRAMSHARD_PACK_AHEAD``), and put in force at its switch
(:meth:`DownCopies.keep`): a prompt chunk after a re-plan made its copies in its own step, its first token late.
The copies a switch drops are freed on a thread of their own (:func:`~.host_allowance.release_later`).

The plain weights stay the source of every copy to the GPU. A copy costs host memory, a third of the
part's weights: ``auto`` (the default) makes copies up to a quarter of the memory the host has available
at the first one (``MemAvailable``), ``on`` without a limit, ``off`` none. Where parts are prepacked
(:mod:`.cpu_packed`) they take no down copy. On an H100 machine nemo-8b at 8 GiB decoded at 7.25 tok/s
with these copies and plain parts, against 9.01 prepacked (docs/BENCHMARKS.md, twenty-seventh GPU
session).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Mapping

import torch

from ..env import choice
from ..layers import cpu_gemv
from .host_allowance import HostAllowance, release_later
from .pinned_host import host_empty

log = logging.getLogger(__name__)

MODES = ("auto", "on", "off")
MODE = choice("VRAMSHARD_CPU_DOWN_COPY", MODES, "auto")


def transposed(down: torch.Tensor) -> bool:
    """Whether ``down`` [D, r] is a view of transposed storage (its rows strided, its columns contiguous)."""
    return down.dim() == 2 and down.stride(-1) != 1 and down.stride(0) == 1


class DownCopies:
    """One executor's row-major copies of CPU parts' down projections: one per FFN, of its widest CPU
    part in the plans in force (:meth:`keep`); a part of fewer pieces reads the copy's leading columns.
    ``views_of(name, pieces)``: the views of an FFN's first ``pieces`` pieces, from which a wider copy
    than the part asked for is made (None: each copy as wide as the part that asked)."""

    def __init__(self, mode: str | None = None,
                 views_of: Callable[[str, int], Mapping[str, torch.Tensor]] | None = None):
        self.mode = mode or MODE
        self._views_of = views_of
        self._copies: dict[str, tuple[int, torch.Tensor]] = {}  # FFN -> (pieces, its down row-major [D, r])
        self._parts: dict[tuple[str, int], dict[str, torch.Tensor]] = {}  # (FFN, pieces) -> the part, down copied
        self._widest: dict[str, int] = {}  # FFN -> most pieces the plans in force compute on the CPU
        self.nbytes = 0
        # Copies made ahead for plans not yet in force (:meth:`stage`), FFN -> (pieces, copy), and the
        # (FFN, pieces) those plans want; keep() puts a staged copy in force with its plans.
        self._staged: dict[str, tuple[int, torch.Tensor]] = {}
        self._expected: set[tuple[str, int]] = set()
        self.staged_nbytes = 0
        self.staging_s = 0.0
        self._lock = threading.Lock()  # (the budget follower's thread stages while the steps' thread keeps)
        self.allowance = HostAllowance("CPU parts' down projections (row-major)", "VRAMSHARD_CPU_DOWN_COPY=on",
                                       limited=self.mode != "on")

    def keep(self, wanted: set[tuple[str, int]]) -> None:
        """The plans in force compute the parts ``wanted`` ((FFN name, pieces on the CPU)): drop the
        copies of other FFNs and those of another width than an FFN's widest part now (the copy of
        that width is made when asked for)."""
        self._widest = _widest(wanted)
        dropped = []
        with self._lock:
            for name, (pieces, copy) in list(self._staged.items()):  # copies made ahead for these plans
                if self._widest.get(name) == pieces:
                    del self._staged[name]
                    self.staged_nbytes -= copy.nbytes
                    if name in self._copies:
                        dropped.append(self._drop(name))
                    self._copies[name] = (pieces, copy)
                    self.nbytes += copy.nbytes
        dropped += [self._drop(name) for name, (pieces, _) in list(self._copies.items())
                    if pieces != self._widest.get(name)]
        release_later(dropped)  # (their memory freed off the switch)

    def stage(self, wanted: set[tuple[str, int]], names: set[str]) -> None:
        """Make ahead, off the steps, the copies that plans not yet in force will read: those plans compute
        the parts ``wanted`` ((FFN name, pieces on the CPU)), and their steps read the FFNs ``names`` through a
        copy (prompt chunks, tiers that do not pack). Each such FFN's down as wide as its widest part there,
        where the copy in force is of another width, within the allowance (the copies in force and staged
        together). :meth:`keep` puts them in force with those plans; the copies staged for plans that never
        come go at the next stage."""
        if self.mode == "off" or self._views_of is None:
            return
        widest = _widest(wanted)
        with self._lock:
            self._expected = {(name, widest[name]) for name in names if name in widest}
            stale = [(name, copy) for name, (pieces, copy) in self._staged.items()
                     if (name, pieces) not in self._expected]
            for name, copy in stale:
                del self._staged[name]
                self.staged_nbytes -= copy.nbytes
        release_later([copy for _, copy in stale])
        for name, pieces in sorted(self._expected):
            held = self._copies.get(name)
            if (held is not None and held[0] == pieces) or name in self._staged:
                continue
            source = self._views_of(name, pieces).get("down_proj")
            if source is None or not transposed(source):
                continue
            with self._lock:
                if not self.allowance.room_for(self.nbytes + self.staged_nbytes, source.nbytes):
                    return
                self.staged_nbytes += source.nbytes  # (held for it while it is made)
            began = time.perf_counter()
            try:
                copy = row_major_copy(source)
            except BaseException:
                with self._lock:
                    self.staged_nbytes -= source.nbytes
                raise
            self.staging_s += time.perf_counter() - began
            with self._lock:
                if (name, pieces) in self._expected:
                    self._staged[name] = (pieces, copy)
                else:  # (another stage came meanwhile)
                    self.staged_nbytes -= copy.nbytes

    def part(self, name: str, cpu_pieces: int, weights: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """``weights`` (the views of FFN ``name``'s first ``cpu_pieces`` pieces) with its down projection
        row-major where it is a transposed view and a copy is allowed (the FFN's copy made here where
        it has none wide enough); else ``weights`` as they are."""
        part = self._parts.get((name, cpu_pieces))
        if part is not None:
            return part
        down = weights.get("down_proj")
        if self.mode == "off" or down is None or not transposed(down):
            return weights
        held = self._copies.get(name)
        if held is None or held[0] < cpu_pieces:
            widest = max(cpu_pieces, self._widest.get(name, 0))
            source = down if widest == cpu_pieces or self._views_of is None else \
                self._views_of(name, widest)["down_proj"]
            if held is not None:
                self._drop(name)
            if not self._room_for(source.nbytes):
                return weights
            start = time.perf_counter()
            copy = row_major_copy(source)
            held = self._copies[name] = (widest if source is not down else cpu_pieces, copy)
            self.nbytes += copy.nbytes
            log.debug("copied %s's CPU down projection row-major (%d piece(s), %.1f MiB) in %.1f ms", name, held[0],
                      copy.nbytes / 2**20, 1e3 * (time.perf_counter() - start))
        part = self._parts[name, cpu_pieces] = {**weights, "down_proj": held[1][:, :down.shape[1]]}
        return part

    def _drop(self, name: str) -> torch.Tensor:
        """Forget FFN ``name``'s copy and the parts read from it; returns the copy (its last reference)."""
        copy = self._copies.pop(name)[1]
        self.nbytes -= copy.nbytes
        for key in [k for k in self._parts if k[0] == name]:
            del self._parts[key]
        return copy

    def _room_for(self, nbytes: int) -> bool:
        return self.allowance.room_for(self.nbytes, nbytes)


def _widest(wanted: set[tuple[str, int]]) -> dict[str, int]:
    """FFN -> the most pieces any of the parts ``wanted`` ((FFN name, pieces)) computes on the CPU."""
    widest: dict[str, int] = {}
    for name, pieces in wanted:
        widest[name] = max(pieces, widest.get(name, 0))
    return widest


def row_major_copy(down: torch.Tensor) -> torch.Tensor:
    """``down`` [D, r], a transposed view, copied row-major into host memory on 2 MiB pages
    (:func:`~vramshard.runtime.pinned_host.host_empty`: fewer page faults while copying, fewer TLB misses
    while reading): by the C library's tiled transpose on torch's threads where it is built, else by
    torch (one thread)."""
    out = host_empty(down.nbytes).view(down.dtype).view(down.shape)
    if cpu_gemv.transpose_into(down, out) is None:
        out.copy_(down)
    return out
