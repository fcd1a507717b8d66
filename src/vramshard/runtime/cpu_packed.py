"""Dense FFNs' CPU parts from weights that oneDNN has prepacked once (``VRAMSHARD_CPU_PACKED``).

On the H200 machine a dense FFN on the CPU at 64 rows took 2.4× its weights' read time (twelfth GPU
session, ``benchmarks/ffn_buffers``). One suspect: oneDNN's half-precision kernels want the weight in
their own blocked layout, and copy a plain (row-major) weight into it on every call. Here a CPU
part's gate+up and down projections are reordered once (``mkldnn._reorder_linear_weight``, as
inductor's CPU freezing does) and computed with ``mkldnn._linear_pointwise``. ``benchmarks.packed_linear``
measures both ways per projection, and ``step_profile``'s ``+packed`` the step.

A packed weight is a second, opaque copy of the part in host memory: the plain one is still the
source of every copy to the GPU. Parts are packed per (FFN, pieces on the CPU) when the executor
takes its plans (at load, at a switch), for the first tier and each decode-sized tier that packs
(since session 37; before, the other tiers' parts were packed in their first step, which stalled a
chat's first short prompt), each for its tier's rows (oneDNN's blocking may depend on them; on the
development machine the hint changed no time); a packed part serves every row count. Where oneDNN cannot pack or
run the dtype on this CPU (fp16 without AVX-512 FP16, say), the first part says so in the log and
every part runs plain.

``VRAMSHARD_CPU_PACKED``: ``auto`` (the default) packs where a CUDA GPU is there (the executor
computes beside it), up to a quarter of the host's available memory
(:mod:`~vramshard.runtime.host_allowance`; parts beyond it run plain); ``on`` packs every part, on any
machine, without a limit; ``off`` packs none. On an H100 machine, nemo-8b decoded at 8 GiB at 9.01
tok/s prepacked against 7.25 plain, one run after the other (docs/BENCHMARKS.md, twenty-seventh GPU
session); the thirteenth session's llama3-8b steps at 8 GiB were 14% (1 row) and 6% (64 rows) shorter.

Only decode-sized steps (up to ``DECODE_ROWS`` rows) read packed parts; prompt chunks compute their
parts plain, with the row-major down copies of :mod:`.cpu_down`. Packing costs time in the step that
first needs a part (the copies and oneDNN's reorder ran at about 2-3 GB/s on the GPU machines'
hosts), again after each re-plan, since a plan splits FFNs anew, and host memory per tier. In the
thirtieth GPU session a 1K prompt of llama3-8b at 8 GiB, the first on a new plan's split 1024-row
tier, packed its parts in the step and took 2.31 s to its first token against a 0.20 s bound; on
its H100 call llama3-8b at 2 GiB held 17.5 GiB of packed parts. Packing buys prompt chunks too
little to pay for that: the H200 machine's five full profiles (sessions 15-33) timed packed FFNs at
256 rows at 0.91-1.47x the plain ones in bf16 and 0.94-1.04x in fp16; on the development machine two
llama3-8b split parts at 128 rows took 0.103 s packed against 0.115 s plain, and packing them 0.53-1.0
s against 0.10 s for their down copies, a cost some 35-75 chunks would pay back (``python -m
benchmarks.first_prompt``; docs/BENCHMARKS.md, session 33).

Since session 48 a re-plan's parts are packed before its plan comes into force (``VRAMSHARD_PACK_AHEAD``, on by
default; its down copies are staged likewise, :meth:`~vramshard.runtime.cpu_down.DownCopies.stage`): the budget
follower's background thread, once the plan is made, packs them (:meth:`PackedParts.pack_ahead`) while the steps
go on under the plan before, and the switch at a step boundary finds them made. At the switch, under the
executor's lock, packing stops the steps: on the development machine a 4-layer llama3-8b's switch took 532-719 ms
packing there, 20-28 ms made ahead (``python -m benchmarks.pack_ahead``); llama3-8b's re-plans on an
H100 machine stopped the steps 1.0-4.8 s each, two (the quick plan and the full one) after each fit, packing
some unrecorded part of it (docs/logs-run48). Parts packed ahead for a plan that never comes into force go at the
next switch after another plan is packed ahead.

A planned engine packs only at the tiers its plan says (``TieredPlacement.packed``), and so, since
session 36, does a named placement beside a GPU (``layers:N`` and the like: the engine runs it at
every tier with the flags a plan's tiers would have, :func:`~vramshard.plan.planner.named_plan`):
where the profile times packed weights at least ``PACK_GAIN`` faster than plain ones at the tier's
rows (:meth:`~vramshard.plan.estimator.Estimator.packs_at`), or at every decode-sized tier with
``on``. The H100 and H200 hosts' profiles time bf16 FFNs packed at 1.04-1.15x plain at 16 and 64
rows, and fp16 ones at 0.85-1.00x; the thirty-first GPU session's llama3-8b engines spent 2.2-3.6 s
packing in each tier's first steps.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterable, Mapping

import torch
import torch.nn.functional as F

from ..env import choice, switch
from ..profile.query import DECODE_ROWS  # the most rows whose parts are read packed (decode steps)
from .host_allowance import HostAllowance, release_later

log = logging.getLogger(__name__)

MODES = ("auto", "on", "off")
MODE = choice("VRAMSHARD_CPU_PACKED", MODES, "auto")
PACK_AHEAD = switch("VRAMSHARD_PACK_AHEAD", default=True)  # a re-plan's parts packed before it comes into force


def packs(mode: str | None = None, gpu: bool | None = None) -> bool:
    """Whether parts are packed in ``mode`` (None: :data:`MODE`) on this machine: asked for (``on``),
    or ``auto`` beside a CUDA GPU (``gpu``; None: whether torch sees one), where oneDNN is there."""
    mode = mode or MODE
    if mode == "off" or not torch.backends.mkldnn.is_available():
        return False
    return mode == "on" or (torch.cuda.is_available() if gpu is None else gpu)


def pack_weight(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """``weight`` [N, K] reordered once into oneDNN's layout for products of about ``rows`` rows (opaque)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), rows)


def packed_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``x`` [T, K] times a :func:`pack_weight` weight: [T, N]."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, None, "none", [], "")


class PackedPart:
    """One split FFN's CPU part (its pieces' gate, up and down) as oneDNN-packed weights."""

    def __init__(self, part: Mapping[str, torch.Tensor], rows: int):
        if "gate_up_proj" in part:  # a whole FFN in the fused layout
            gate_up = part["gate_up_proj"].contiguous()
        else:
            gate_up = torch.cat([part["gate_proj"], part["up_proj"]], dim=0)  # [2r, D]
        self.width = gate_up.shape[0] // 2  # r
        self.gate_up = pack_weight(gate_up, rows)
        self.down = pack_weight(part["down_proj"], rows)  # [D, r]
        self.nbytes = gate_up.nbytes + part["down_proj"].nbytes  # (as plain; the packed size is opaque)

    def contribution(self, h: torch.Tensor) -> torch.Tensor:
        """The part's share of the FFN output for the normalized ``h`` [T, D], no residual."""
        both = packed_linear(h, self.gate_up)  # [T, 2r]
        gated, lifted = both.split(self.width, dim=-1)
        return packed_linear(F.silu(gated) * lifted, self.down)


class PackedParts:
    """One executor's packed CPU parts by (FFN name, pieces on the CPU); None where packing is off,
    failed on this CPU or (``auto``) past the allowance (then the plain part is used). ``mode``:
    as ``VRAMSHARD_CPU_PACKED`` (None: its value); ``gpu``: whether the executor computes beside a
    GPU, for ``auto`` (None: whether torch sees one)."""

    def __init__(self, mode: str | None = None, gpu: bool | None = None):
        mode = mode or MODE
        self._parts: dict[tuple[str, int], PackedPart] = {}
        self._refused: set[tuple[str, int]] = set()  # parts past the allowance (asked again after keep)
        self._failed: str | None = None if packs(mode, gpu) else "off"
        self._probed = False  # oneDNN has computed with a packed part here
        self.allowance = HostAllowance("CPU FFN parts prepacked for oneDNN", "VRAMSHARD_CPU_PACKED=on",
                                       limited=mode != "on")
        self.nbytes = 0
        # Seconds spent packing so far: one-time work, not a step's CPU work (the engine fits its
        # profile to the latter; a 1024-row chunk that packed 7 GiB once read as 5.9x its prediction).
        self.packing_s = 0.0
        # Whether the plans in force pack at a step's rows (TieredPlacement.packs; the executor sets it).
        self.packs_rows: Callable[[int], bool] = lambda rows: True
        # Parts packed (or being packed) ahead for a plan not yet in force: kept by keep() until a plan that
        # computes them all is. Their seconds go to ahead_s: off the steps, they are no step's either.
        self._ahead: set[tuple[str, int]] = set()
        self.ahead_s = 0.0
        # The budget follower's thread packs ahead while the steps' thread reads and packs: one packs at a time.
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        """Whether parts are (still) packed, those within the allowance: asked for (or ``auto`` beside a
        GPU), and oneDNN has not failed at it here."""
        return self._failed is None

    def keep(self, wanted: set[tuple[str, int]]) -> None:
        """Drop the packed parts not in ``wanted`` ((FFN name, pieces on the CPU) of the plans in
        force): each plan of another budget or calibration splits FFNs anew, and a packed copy of
        every split ever used would grow past the plain weights (the thirteenth GPU session: 144
        parts, 11.8 GiB beside a 16 GB model)."""
        dropped = []
        with self._lock:
            for key in [k for k in self._parts if k not in wanted and k not in self._ahead]:
                dropped.append(self._parts.pop(key))
                self.nbytes -= dropped[-1].nbytes
            if self._ahead <= wanted:
                self._ahead = set()  # (the plan they were packed for is in force)
            self._refused.clear()  # (room may have come back)
        release_later(dropped)  # (their memory freed off the switch)

    def expect(self, keys: Iterable[tuple[str, int]]) -> None:
        """The parts ((FFN name, pieces on the CPU)) of the plan about to be packed ahead: keep() keeps
        them until a plan computing them all is in force; those of an earlier plan packed ahead go."""
        with self._lock:
            self._ahead = set(keys)

    def pack_ahead(self, name: str, cpu_pieces: int, part: Mapping[str, torch.Tensor], rows: int) -> PackedPart | None:
        """Pack a part of a plan not yet in force (see :meth:`expect`), off the steps: as :meth:`get`
        would in the plan's first step, whatever the plans in force pack; its seconds count in ``ahead_s``."""
        if self._failed is not None or rows > DECODE_ROWS:
            return None
        began = time.perf_counter()
        packed = self._pack(name, cpu_pieces, part, rows)
        self.ahead_s += time.perf_counter() - began
        return packed

    def get(self, name: str, cpu_pieces: int, part: Mapping[str, torch.Tensor], rows: int) -> PackedPart | None:
        """The packed part for a step of ``rows`` rows, packed here on first use; None for a prompt
        chunk's (more than DECODE_ROWS rows), a tier the plans in force do not pack at, where packing
        is off or failed, or past the allowance."""
        if self._failed is not None or rows > DECODE_ROWS or not self.packs_rows(rows):
            return None
        packed = self._parts.get((name, cpu_pieces))
        if packed is None and (name, cpu_pieces) not in self._refused:  # (a refused part: answered without the sums)
            began = time.perf_counter()
            packed = self._pack(name, cpu_pieces, part, rows)
            self.packing_s += time.perf_counter() - began  # (with any wait for a part packed ahead meanwhile)
        return packed

    def _pack(self, name: str, cpu_pieces: int, part: Mapping[str, torch.Tensor], rows: int) -> PackedPart | None:
        """The part packed (here unless it already is), or None past the allowance or where oneDNN failed."""
        key = (name, cpu_pieces)
        with self._lock:
            packed = self._parts.get(key)
            if packed is not None or key in self._refused or self._failed is not None:
                return packed
            nbytes = sum(t.nbytes for k, t in part.items() if k.endswith("_proj"))
            if not self.allowance.room_for(self.nbytes, nbytes):
                self._refused.add(key)
                return None
            weight = part["gate_up_proj"] if "gate_up_proj" in part else part["gate_proj"]  # [r, D]
            try:
                packed = PackedPart(part, rows)
                if not self._probed:  # (a CPU that cannot run the dtype fails here, once; one row suffices)
                    packed.contribution(torch.zeros(1, weight.shape[1], dtype=weight.dtype))
                    self._probed = True
            except RuntimeError as exc:
                self._failed = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                log.warning("split FFNs' CPU parts run from plain weights: oneDNN cannot pack them here (%s)",
                            self._failed)
                return None
            self._parts[key] = packed
            self.nbytes += packed.nbytes
            if len(self._parts) == 1 or len(self._parts) % 16 == 0:
                log.info("packed %d split FFN CPU part(s) for oneDNN (%.2f GiB beside the plain weights)",
                         len(self._parts), self.nbytes / 2**30)
            return packed
