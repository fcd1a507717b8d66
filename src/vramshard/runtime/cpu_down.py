"""Row-major copies of the down projections the CPU computes from a splittable FFN (``VRAMSHARD_CPU_DOWN_COPY``).

A dense FFN packed so plans may split it stores ``down_proj`` transposed ([F, D]), so that the GPU
part of a split streams as a few contiguous ranges (:mod:`~vramshard.runtime.host_weights`). The CPU
then reads down as a transposed view ([D, r], its rows strided), and its products read that layout
slowly: on the 2-core development machine (session 28, ``python -m benchmarks.cpu_layouts``) a
llama3-8b quarter part's down of one token took 2.47 ms through ATen from the transposed view, 1.87 ms
from a row-major copy and 0.77 ms as the compiled row sums a row-major copy allows
(:mod:`~vramshard.layers.cpu_swiglu`), its weights' read time being 0.55 ms; at 4, 16 and 64 rows the
copy was 1.55x, 1.38x and 1.16x faster through ATen.

Here a CPU part's down (a split FFN's first pieces, or a whole FFN the CPU computes) gets a row-major
copy, per (FFN, pieces on the CPU): the first tier's parts' when the executor takes its plans (at
load, at a switch), the others' in their first step; each is kept while the plans in force compute that
part (:meth:`DownCopies.keep`). The plain weights stay the source of every copy to the GPU. A copy
costs host memory, a third of the part's weights: ``auto`` (the default) makes copies up to a quarter
of the memory the host has available at the first one (``MemAvailable``), ``on`` without a limit,
``off`` none. Where parts are prepacked (:mod:`.cpu_packed`, the default beside a GPU) they take no
down copy. On an H100 machine nemo-8b at 8 GiB decoded at 7.25 tok/s with these copies and plain parts,
against 9.01 prepacked (docs/BENCHMARKS.md, twenty-seventh GPU session).
"""

from __future__ import annotations

import logging
import time
from typing import Mapping

import torch

from ..env import choice
from .host_allowance import HostAllowance

log = logging.getLogger(__name__)

MODES = ("auto", "on", "off")
MODE = choice("VRAMSHARD_CPU_DOWN_COPY", MODES, "auto")


def transposed(down: torch.Tensor) -> bool:
    """Whether ``down`` [D, r] is a view of transposed storage (its rows strided, its columns contiguous)."""
    return down.dim() == 2 and down.stride(-1) != 1 and down.stride(0) == 1


class DownCopies:
    """One executor's row-major copies of CPU parts' down projections, by (FFN name, pieces on the CPU)."""

    def __init__(self, mode: str | None = None):
        self.mode = mode or MODE
        self._parts: dict[tuple[str, int], dict[str, torch.Tensor]] = {}  # the parts' views, down copied
        self.nbytes = 0
        self.allowance = HostAllowance("CPU parts' down projections (row-major)", "VRAMSHARD_CPU_DOWN_COPY=on",
                                       limited=self.mode != "on")

    def keep(self, wanted: set[tuple[str, int]]) -> None:
        """Drop the copies of parts not in ``wanted`` ((FFN name, pieces on the CPU) of the plans in force)."""
        for key in [k for k in self._parts if k not in wanted]:
            self.nbytes -= self._parts.pop(key)["down_proj"].nbytes

    def part(self, name: str, cpu_pieces: int, weights: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """``weights`` (a CPU part's views) with its down projection row-major where it is a transposed
        view and a copy is allowed (made here on first use); else ``weights`` as they are."""
        copied = self._parts.get((name, cpu_pieces))
        if copied is not None:
            return copied
        down = weights.get("down_proj")
        if self.mode == "off" or down is None or not transposed(down) or not self._room_for(down.nbytes):
            return weights
        start = time.perf_counter()
        copied = self._parts[name, cpu_pieces] = {**weights, "down_proj": down.contiguous()}
        self.nbytes += down.nbytes
        log.debug("copied %s's CPU down projection row-major (%d piece(s), %.1f MiB) in %.1f ms", name, cpu_pieces,
                  down.nbytes / 2**20, 1e3 * (time.perf_counter() - start))
        return copied

    def _room_for(self, nbytes: int) -> bool:
        return self.allowance.room_for(self.nbytes, nbytes)
