"""Dense FFNs' CPU parts from weights that oneDNN has prepacked once (``VRAMSHARD_CPU_PACKED``).

On the H200 machine a dense FFN on the CPU at 64 rows took 2.4× its weights' read time (twelfth GPU
session, ``benchmarks/ffn_buffers``). One suspect: oneDNN's half-precision kernels want the weight in
their own blocked layout, and copy a plain (row-major) weight into it on every call. Here a CPU
part's gate+up and down projections are reordered once (``mkldnn._reorder_linear_weight``, as
inductor's CPU freezing does) and computed with ``mkldnn._linear_pointwise``. ``benchmarks.packed_linear``
measures both ways per projection, and ``step_profile``'s ``+packed`` the step.

A packed weight is a second, opaque copy of the part in host memory: the plain one is still the
source of every copy to the GPU. Parts are packed per (FFN, pieces on the CPU): the first tier's when
the executor takes its plans (at load, at a switch), the others' in the first step that computes
them, each for the rows of that step (oneDNN's blocking may depend on them; on the development
machine the hint changed no time); a packed part serves every row count. Where oneDNN cannot pack or
run the dtype on this CPU (fp16 without AVX-512 FP16, say), the first part says so in the log and
every part runs plain.

``VRAMSHARD_CPU_PACKED``: ``auto`` (the default) packs where a CUDA GPU is there (the executor
computes beside it), up to a quarter of the host's available memory
(:mod:`~vramshard.runtime.host_allowance`; parts beyond it run plain); ``on`` packs every part, on any
machine, without a limit; ``off`` packs none. On an H100 machine, nemo-8b decoded at 8 GiB at 9.01
tok/s prepacked against 7.25 plain, one run after the other (docs/BENCHMARKS.md, twenty-seventh GPU
session); the thirteenth session's llama3-8b steps at 8 GiB were 14% (1 row) and 6% (64 rows) shorter.

Packing takes time: the copies and oneDNN's reorder ran at about 2-3 GB/s on the H200 machine's host,
and a new plan splits FFNs anew, so its parts are packed again. Parts of decode-sized steps (up to
``cpu_swiglu.MAX_ROWS`` rows, many steps each) are packed in the step that first needs them: plain,
their few-row products would compile kernels there instead. Parts of prompt chunks are packed by a
background thread (``VRAMSHARD_CPU_PACK_BACKGROUND``, on by default) on a quarter of the cores: the
step that asks first, and any before the part is ready, computes it from the plain weights through
torch's own matrix products, which need no compile. In the thirty-third GPU session (H200 machine)
a 1K prompt of llama3-8b at 8 GiB, the first after a re-plan made its 1024-row tier split, took
2.31 s to its first token against 0.20 s for the (PCIe + compute) bound, most of it packing in the
step. oneDNN is asked to compute once, with one row, after the first part is packed (a CPU that
cannot run the dtype fails there); the parts after it are not run before their first step.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Mapping

import torch
import torch.nn.functional as F

from ..env import choice, switch
from ..layers import cpu_swiglu
from .host_allowance import HostAllowance

log = logging.getLogger(__name__)

MODES = ("auto", "on", "off")
MODE = choice("VRAMSHARD_CPU_PACKED", MODES, "auto")
BACKGROUND = switch("VRAMSHARD_CPU_PACK_BACKGROUND", default=True)
BACKGROUND_SHARE = 4  # the background packer's OpenMP team: this share of the cores (at least one)


def packs(mode: str | None = None, gpu: bool | None = None) -> bool:
    """Whether parts are packed in ``mode`` (None: :data:`MODE`) on this machine: asked for (``on``),
    or ``auto`` beside a CUDA GPU (``gpu``; None: whether torch sees one), where oneDNN is there."""
    mode = mode or MODE
    if mode == "off" or not torch.backends.mkldnn.is_available():
        return False
    return mode == "on" or (torch.cuda.is_available() if gpu is None else gpu)


class PackedPart:
    """One split FFN's CPU part (its pieces' gate, up and down) as oneDNN-packed weights."""

    def __init__(self, part: Mapping[str, torch.Tensor], rows: int):
        if "gate_up_proj" in part:  # a whole FFN in the fused layout
            gate_up = part["gate_up_proj"].contiguous()
        else:
            gate_up = torch.cat([part["gate_proj"], part["up_proj"]], dim=0)  # [2r, D]
        self.width = gate_up.shape[0] // 2  # r
        self.gate_up = torch.ops.mkldnn._reorder_linear_weight(gate_up, rows)
        self.down = torch.ops.mkldnn._reorder_linear_weight(part["down_proj"].contiguous(), rows)  # [D, r]
        self.nbytes = gate_up.nbytes + part["down_proj"].nbytes  # (as plain; the packed size is opaque)

    def contribution(self, h: torch.Tensor) -> torch.Tensor:
        """The part's share of the FFN output for the normalized ``h`` [T, D], no residual."""
        both = torch.ops.mkldnn._linear_pointwise(h.contiguous(), self.gate_up, None, "none", [], "")  # [T, 2r]
        gated, lifted = both.split(self.width, dim=-1)
        return torch.ops.mkldnn._linear_pointwise(F.silu(gated) * lifted, self.down, None, "none", [], "")


class PackedParts:
    """One executor's packed CPU parts by (FFN name, pieces on the CPU); None where packing is off,
    failed on this CPU or (``auto``) past the allowance (then the plain part is used). ``mode``:
    as ``VRAMSHARD_CPU_PACKED`` (None: its value); ``gpu``: whether the executor computes beside a
    GPU, for ``auto`` (None: whether torch sees one); ``background``: whether prompt chunks' parts
    are packed by a background thread (None: ``VRAMSHARD_CPU_PACK_BACKGROUND``)."""

    def __init__(self, mode: str | None = None, gpu: bool | None = None, background: bool | None = None):
        mode = mode or MODE
        self._parts: dict[tuple[str, int], PackedPart] = {}
        self._refused: set[tuple[str, int]] = set()  # parts past the allowance (asked again after keep)
        self._failed: str | None = None if packs(mode, gpu) else "off"
        self._probed = False  # oneDNN has computed with a packed part here
        self.allowance = HostAllowance("CPU FFN parts prepacked for oneDNN", "VRAMSHARD_CPU_PACKED=on",
                                       limited=mode != "on")
        self.nbytes = 0
        # Seconds spent packing in steps so far: one-time work, not a step's CPU work (the engine fits
        # its profile to the latter; a 1024-row chunk that packed 7 GiB once read as 5.9x its prediction).
        self.packing_s = 0.0
        self.background = BACKGROUND if background is None else background
        self.background_s = 0.0  # seconds the background thread spent packing
        self._lock = threading.Lock()  # _parts, _pending, _queue, nbytes between the step and the thread
        self._pending: dict[tuple[str, int], int] = {}  # parts queued or being packed -> their bytes
        self._queue: collections.deque = collections.deque()  # (key, part, rows) for the thread
        self._thread: threading.Thread | None = None
        self.finished_at = 0.0  # time.time() when the thread last ran out of work

    @property
    def enabled(self) -> bool:
        """Whether parts are (still) packed, those within the allowance: asked for (or ``auto`` beside a
        GPU), and oneDNN has not failed at it here."""
        return self._failed is None

    @property
    def busy(self) -> bool:
        """Whether the background thread is packing now (a step beside it shares the host's memory)."""
        return self._thread is not None

    def pending(self, name: str, cpu_pieces: int) -> bool:
        """Whether that part is being packed in the background (its steps meanwhile run plain)."""
        return (name, cpu_pieces) in self._pending

    def wait(self, timeout: float | None = None) -> None:
        """Until the background thread has packed every part asked for (tests, benchmarks)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def keep(self, wanted: set[tuple[str, int]]) -> None:
        """Drop the packed parts not in ``wanted`` ((FFN name, pieces on the CPU) of the plans in
        force): each plan of another budget or calibration splits FFNs anew, and a packed copy of
        every split ever used would grow past the plain weights (the thirteenth GPU session: 144
        parts, 11.8 GiB beside a 16 GB model). Parts queued for the background thread and no
        longer wanted are not packed (one being packed is dropped when done)."""
        with self._lock:
            for key in [k for k in self._parts if k not in wanted]:
                self.nbytes -= self._parts.pop(key).nbytes
            for key in [k for k in self._pending if k not in wanted]:
                del self._pending[key]
            self._queue = collections.deque(job for job in self._queue if job[0] in self._pending)
            self._refused.clear()  # (room may have come back)

    def get(self, name: str, cpu_pieces: int, part: Mapping[str, torch.Tensor], rows: int) -> PackedPart | None:
        """The packed part, packed here on first use for a decode-sized ``rows``; for a prompt chunk's
        (more than ``cpu_swiglu.MAX_ROWS``) handed to the background thread where that is on, None
        until it is ready. None too where packing is off, failed, or the part is past the allowance."""
        if self._failed is not None:
            return None
        key = (name, cpu_pieces)
        with self._lock:
            packed = self._parts.get(key)
            if packed is not None or key in self._pending or key in self._refused:
                return packed  # (refused ones are asked again each step: answered without the sums)
            nbytes = sum(t.nbytes for k, t in part.items() if k.endswith("_proj"))
            if not self.allowance.room_for(self.nbytes + sum(self._pending.values()), nbytes):
                self._refused.add(key)
                return None
            if self.background and rows > cpu_swiglu.MAX_ROWS:
                self._pending[key] = nbytes
                self._queue.append((key, part, rows))
                if self._thread is None:
                    threads = max(1, torch.get_num_threads() // BACKGROUND_SHARE)
                    self._thread = threading.Thread(target=self._run, args=(threads,), name="vramshard-pack",
                                                    daemon=True)
                    self._thread.start()
                return None
        began = time.perf_counter()
        packed = self._pack(part, rows)
        self.packing_s += time.perf_counter() - began
        if packed is not None:
            with self._lock:
                self._store(key, packed)
        return packed

    def _pack(self, part: Mapping[str, torch.Tensor], rows: int) -> PackedPart | None:
        """``part`` packed (for ``rows``), oneDNN asked to compute with it once per executor; None
        where it cannot here (said once; every part then runs plain)."""
        weight = part["gate_up_proj"] if "gate_up_proj" in part else part["gate_proj"]  # [r, D]
        try:
            with torch.no_grad():
                packed = PackedPart(part, rows)
                if not self._probed:
                    packed.contribution(torch.zeros(1, weight.shape[1], dtype=weight.dtype))
                    self._probed = True
        except RuntimeError as exc:
            self._failed = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            log.warning("split FFNs' CPU parts run from plain weights: oneDNN cannot pack them here (%s)",
                        self._failed)
            return None
        return packed

    def _store(self, key: tuple[str, int], packed: PackedPart) -> None:
        """Keep a packed part (caller holds the lock)."""
        self._parts[key] = packed
        self.nbytes += packed.nbytes
        if len(self._parts) == 1 or len(self._parts) % 16 == 0:
            log.info("packed %d split FFN CPU part(s) for oneDNN (%.2f GiB beside the plain weights)",
                     len(self._parts), self.nbytes / 2**30)

    def _run(self, threads: int) -> None:
        """The background thread: pack the queued parts in turn on ``threads`` OpenMP threads (this
        thread's own count), then end."""
        torch.set_num_threads(threads)
        while True:
            with self._lock:
                if not self._queue or self._failed is not None:
                    self._queue.clear()
                    self._pending.clear()
                    self._thread = None
                    self.finished_at = time.time()
                    return
                key, part, rows = self._queue.popleft()
            began = time.perf_counter()
            try:
                packed = self._pack(part, rows)
            except Exception:  # (the step computes the part plain meanwhile, and after)
                log.exception("packing %s's CPU part in the background failed", key[0])
                packed = None
            with self._lock:
                self.background_s += time.perf_counter() - began
                if self._pending.pop(key, None) is not None and packed is not None:  # (still wanted)
                    self._store(key, packed)
