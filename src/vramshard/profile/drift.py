"""Does the host read memory as fast now as when it was profiled? The profile's CPU side scaled to now.

A profile is measured once, and the host it describes moves: the lent H200 machines' boots read
host memory at 79 to 108 GB/s (docs/BENCHMARKS.md, twenty-second GPU session), and a laptop on
battery, or with a game beside it, reads slower than on the day it was profiled. A one-token step's
CPU work reads its weights once, so its time follows that bandwidth.

When the engine loads, :func:`corrected` times the host's memory read the way the profile did
(:func:`~vramshard.profile.bench_memory.measure_cpu_read`, about 0.3 s) and scales the profile's
CPU compute by then / now (:meth:`~vramshard.profile.query.Profile.calibrated`, ``cpu_scale``)
when they differ by more than :data:`TOLERANCE`. Replayed over the report's 146 measured decode
steps on hosts that read 79-127 GB/s (``python -m benchmarks.report_replay --profile-read-gb-s``;
docs/BENCHMARKS.md, session 24), that scaling took the steps priced within 15% from 88 to 98, the
CPU-computing baselines' from 43 to 52 of 73. The GPU side, PCIe included, repeats within 2%
between profiles and is left as measured.

Steps of many rows are bound by the CPU's arithmetic rather than its read, and hosts that read alike
can compute far apart: the H100 machines share one fingerprint, and the profile measured in session 40
multiplied bf16 ``[64, 4096] @ [4096, 14336]`` at 7.3 TFLOP/s where session 53's host, reading at 0.57x
its rate, ran the same step's CPU work at about 2 TFLOP/s (3.5x the profile's time, 2x what the read
alone allowed for). So the check also times one of the profile's own CPU products at :data:`COMPUTE_ROWS`
rows (:func:`measure_compute`, a fraction of a second) and prices CPU compute of those rows by what it
finds beyond the read's scale (``compute_rows``, :meth:`~vramshard.profile.query.Profile.calibrated`);
the engine's own fit of its measured steps (:mod:`vramshard.plan.calibrate`) corrects what is left.
``VRAMSHARD_COMPUTE_DRIFT=off`` keeps to the read's scale.

It runs once per process for each profile, only on a profile of this machine that recorded its
read bandwidth (same fingerprint; not a synthetic one; not one already scaled).
``VRAMSHARD_DRIFT_CHECK=off`` keeps the profile as measured.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field

import torch

from ..env import switch
from ..errors import ProfileError
from .bench_memory import measure_cpu_read
from .fingerprint import fingerprint_hash, machine_fingerprint
from .query import DECODE_ROWS, KERNEL_ROWS, Profile, dtype_name

log = logging.getLogger(__name__)

# Within one boot the read repeats within 4% on the H200 machine and 10% across processes on the
# 2-core development machine; boots of the H200 machine differ by up to 35%.
TOLERANCE = 0.10
LIMITS = (1 / 3, 3.0)  # scales beyond these are clamped, with a word to measure the profile again
BUDGET_S = 0.1  # the read timing's budget (the buffer's allocation comes on top)


@dataclass(frozen=True)
class Drift:
    """The host's memory read when profiled and now (bytes/s), and the check's wall time."""

    profiled_bps: float
    now_bps: float
    took_s: float

    @property
    def scale(self) -> float:
        """Factor on CPU compute times: above 1, the host reads slower now than when profiled."""
        return self.profiled_bps / self.now_bps


@dataclass(frozen=True)
class ComputeDrift:
    """Seconds of one ``[rows, K] @ [K, N]`` CPU product (``shape`` = (K, N), ``dtype``, all threads) in
    the profile's table and as timed now, by rows; the same product from oneDNN-prepacked weights now, at
    a decode step's rows where the executor packs (``packed_s``; empty where it does not); and the check's
    wall time."""

    shape: tuple[int, int]
    dtype: str
    profiled_s: dict[int, float]
    now_s: dict[int, float]
    took_s: float
    packed_s: dict[int, float] = field(default_factory=dict)

    def factors(self) -> dict[int, float]:
        """{rows: now / profiled}: above 1, the host computes that many rows slower now."""
        return {m: self.now_s[m] / self.profiled_s[m] for m in self.now_s}

    def packed_factors(self) -> dict[int, float]:
        """{rows: packed / plain now} (the profile's ``packed_ffn`` factors, timed here)."""
        return {m: self.packed_s[m] / self.now_s[m] for m in self.packed_s if m in self.now_s}


# The rows timed: the engine's decode tiers above the C kernel's rows (KERNEL_ROWS and fewer read their weights
# and follow the read), 16 and 64 (DECODE_ROWS), and a prompt chunk's. Not 8 (session 54 timed it too): on the
# forty-ninth GPU session's host bf16 [8, 14336] @ [14336, 4096] took 2.4-2.8 ms, longer than at 16 rows (1.5-1.6),
# where [8, 4096] @ [4096, 14336] took 1.4-1.5; the one shape's factor priced the other's 8 rows at 1.9-2.1x.
COMPUTE_ROWS = (16, 64, 512)
COMPUTE_ELEMENTS = 64 * 2**20  # the largest weight timed: an 8B model's FFN projection (4096 x 14336)
COMPUTE_BUDGET_S = 0.03  # per row count (the weight's making and its cold copies come on top)
COMPUTE_LIMITS = (1 / 8, 8.0)  # beyond the read's scale; wider than LIMITS: the same product, timed here

_CHECKED: dict[tuple[str, str], Drift] = {}  # (fingerprint hash, created) -> drift
_COMPUTED: dict[tuple[str, str, str], ComputeDrift | None] = {}  # (fingerprint hash, created, dtype) -> timing
_COPIES: dict[tuple[str, str, str], float] = {}  # ("copies", fingerprint hash, created) -> seconds of the copy now
_LOCK = threading.Lock()


def enabled() -> bool:
    return switch("VRAMSHARD_DRIFT_CHECK", default=True)


def compute_enabled() -> bool:
    """``VRAMSHARD_COMPUTE_DRIFT`` (on unless ``VRAMSHARD_DRIFT_CHECK`` is off): time CPU compute too."""
    return enabled() and switch("VRAMSHARD_COMPUTE_DRIFT", default=True)


def is_this_machines(profile: Profile) -> bool:
    """Whether ``profile`` was measured on this machine (its fingerprint), not made up (synthetic)."""
    if profile.data.get("synthetic"):
        return False
    return profile.fingerprint_hash == fingerprint_hash(machine_fingerprint())


def measure(profile: Profile, budget_s: float = BUDGET_S) -> Drift | None:
    """Time the host's memory read now with the profile's thread count; None when the profile did
    not record its own (profiles made before 2026-12-04)."""
    if not profile.cpu_read_bps:
        return None
    started = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(profile.default_threads)
    try:
        now = measure_cpu_read(budget_s)
    finally:
        torch.set_num_threads(threads)
    return Drift(profile.cpu_read_bps, now, time.perf_counter() - started)


def corrected(profile: Profile, dtype=None) -> Profile:
    """``profile`` with its CPU compute scaled to how fast this host reads memory now (see the
    module), no further than its one-row products of ``dtype`` (the model's; None: any) allow
    (:func:`read_floor`), and its compute of many rows to how fast the host computes them now
    (:func:`compute_factors`); the profile itself where the check does not apply or finds it within
    :data:`TOLERANCE`."""
    if not enabled() or profile.cpu_scale != 1.0 or profile.cpu_rows or profile.compute_rows \
            or not profile.cpu_read_bps or not is_this_machines(profile):
        return profile
    key = (profile.fingerprint_hash, str(profile.data.get("created", "")))
    with _LOCK:  # once per process and profile: engines built later reuse it
        if key not in _CHECKED:
            drift = measure(profile)
            if drift is None:
                return profile
            _CHECKED[key] = drift
            log.info("host memory read %.1f GB/s now, %.1f GB/s when profiled (checked in %.2f s)",
                     drift.now_bps / 1e9, drift.profiled_bps / 1e9, drift.took_s)
        drift = _CHECKED[key]
    scale = read_scale(profile, drift, dtype)
    rows = compute_factors(profile, dtype, scale)
    packed = packed_factors(profile, dtype)
    if scale == 1.0 and not rows and not packed:
        return profile
    scaled = profile.calibrated(cpu_scale=scale, compute_rows=rows or None)
    return scaled.with_packed_now(_dtype(dtype), packed) if packed else scaled


def read_scale(profile: Profile, drift: Drift, dtype=None) -> float:
    """The scale on ``profile``'s CPU compute that ``drift`` (the host's read then and now) asks for: 1
    within :data:`TOLERANCE`, clamped to :data:`LIMITS`, no faster than :func:`read_floor`."""
    if abs(math.log(drift.scale)) <= math.log1p(TOLERANCE):
        return 1.0
    scale = min(max(drift.scale, LIMITS[0]), LIMITS[1])
    if scale != drift.scale:
        log.warning("the host reads memory at x%.2f the profile's rate now; planning with CPU times x%.2f. "
                    "If this machine changed for good, measure it again (`vramshard profile`)",
                    1 / drift.scale, scale)
    floor = min(read_floor(profile, drift.now_bps, dtype), 1.0)  # (it only holds back a speed-up)
    if scale < floor:
        within = abs(math.log(floor)) <= math.log1p(TOLERANCE)
        log.info("planning with the profile's CPU times %s, not x%.2f as the host's read alone says: its one-row "
                 "products already read their weights at %.1f GB/s, and the host reads %.1f GB/s now",
                 "as measured" if within else f"x{floor:.2f}", scale, profile.one_row_read_bps(dtype) / 1e9,
                 drift.now_bps / 1e9)
        return 1.0 if within else floor
    if scale == drift.scale:
        log.info("planning with the profile's CPU times x%.2f (the host reads memory %s now than when profiled)",
                 scale, "slower" if scale > 1 else "faster")
    return scale


def compute_factors(profile: Profile, dtype, scale: float) -> dict[int, float]:
    """{rows: factor} on ``profile``'s CPU compute of that many rows beyond ``scale`` (the read's): this
    host's time of the profile's product now over the table's (:func:`measure_compute`, once per process,
    profile and dtype) over ``scale``, within :data:`COMPUTE_LIMITS`. Every row count timed where any is off
    by more than :data:`TOLERANCE` (rows between them then interpolate between timings); none where none is,
    the check is off, or the profile has no product to time."""
    timed = _compute_timed(profile, dtype)
    if timed is None:
        return {}
    rows = {m: min(max(factor / scale, COMPUTE_LIMITS[0]), COMPUTE_LIMITS[1]) for m, factor in timed.factors().items()}
    if all(abs(math.log(f)) <= math.log1p(TOLERANCE) for f in rows.values()):
        return {}
    log.info("planning with the profile's CPU compute by rows x%s beyond the read's scale (the host computes them so "
             "now)", {m: round(f, 2) for m, f in rows.items()})
    return rows


def packed_factors(profile: Profile, dtype) -> dict[int, float]:
    """{rows: packed time over plain} as this host runs ``dtype``'s products now (:func:`measure_compute`),
    where the executor packs and any row count is off the profile's ``packed_ffn`` factor by more than
    :data:`TOLERANCE` (then every row timed); else none. The hosts' profiles disagree: ``h100-run40``
    timed bf16 FFNs packed at 0.60x plain at 64 rows, ``h200-run49`` at 1.22x, and an engine priced and
    packed its parts by the profile's."""
    timed = _compute_timed(profile, dtype)
    if timed is None or not timed.packed_s:
        return {}
    now = timed.packed_factors()
    profiled = {m: profile.packed_ffn_factor(timed.dtype, m) for m in now}
    if all(abs(math.log(f / profiled[m])) <= math.log1p(TOLERANCE) for m, f in now.items()):
        return {}
    log.info("planning with dense FFNs on the CPU prepacked at x%s plain by rows (timed now; the profile has %s)",
             {m: round(f, 2) for m, f in now.items()}, {m: round(f, 2) for m, f in profiled.items()})
    return now


def _compute_timed(profile: Profile, dtype) -> ComputeDrift | None:
    """The compute check's timing for ``profile`` and ``dtype`` (None: off, or nothing to time): made once per
    process, profile and dtype."""
    if not compute_enabled():
        return None
    key = (profile.fingerprint_hash, str(profile.data.get("created", "")), _dtype(dtype))
    with _LOCK:
        if key not in _COMPUTED:
            timed = _COMPUTED[key] = measure_compute(profile, key[2])
            if timed is not None:
                log.info("CPU %s [rows, %d] @ [%d, %d] now / when profiled, by rows: %s%s (checked in %.2f s)",
                         timed.dtype, timed.shape[0], *timed.shape,
                         ", ".join(f"{m}: {f:.2f}" for m, f in timed.factors().items()),
                         "; prepacked / plain now: " + ", ".join(f"{m}: {f:.2f}" for m, f in
                                                                timed.packed_factors().items())
                         if timed.packed_s else "", timed.took_s)
        return _COMPUTED[key]


def measure_compute(profile: Profile, dtype: str) -> ComputeDrift | None:
    """Time the largest weight of ``profile``'s CPU matmul table in ``dtype`` up to :data:`COMPUTE_ELEMENTS`
    at :data:`COMPUTE_ROWS` rows (those above the C kernel's that the table measured) the way the profiler
    did (:func:`~vramshard.profile.bench_matmul.linear_over` cold copies, the CPU's path for the shape settled,
    the profile's threads), and from the same copies prepacked (:func:`measure_packed`); None where the table
    has no such shape or rows."""
    from .bench_matmul import cold_copies, linear_over
    from .spec import torch_dtype
    from .timing import time_cpu

    try:
        shapes, ms = profile.matmul_grid(dtype, "cpu")
    except ProfileError:
        return None
    rows = [m for m in COMPUTE_ROWS if m in ms and m > KERNEL_ROWS]
    fitting = [tuple(s) for s in shapes if s[0] * s[1] <= COMPUTE_ELEMENTS]
    if not rows or not fitting:
        return None
    k, n = max(fitting, key=lambda s: (s[0] * s[1], s))
    started = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(profile.default_threads)
    dt = torch_dtype(dtype)
    try:
        copies = cold_copies(torch.randn(n, k, dtype=dt) * 0.02)  # [N, K] each
        now = {m: time_cpu(linear_over(torch.randn(m, k, dtype=dt), copies), COMPUTE_BUDGET_S) for m in rows}
        packed = measure_packed(copies, [m for m in rows if m <= DECODE_ROWS])
    finally:
        torch.set_num_threads(threads)
    profiled = {m: profile.matmul_s(m, k, n, dtype, "cpu") for m in rows}
    return ComputeDrift((k, n), dtype, profiled, now, time.perf_counter() - started, packed)


def measure_packed(copies: list[torch.Tensor], rows: list[int]) -> dict[int, float]:
    """{rows: seconds} of ``[rows, K]`` times the ``copies`` ([N, K] each, cold) prepacked as the executor packs
    them (:func:`~vramshard.runtime.cpu_packed.pack_weight`), in turn, where the executor packs
    (:func:`~vramshard.runtime.cpu_packed.packs`: beside a GPU by default) and oneDNN packs their dtype here;
    else none."""
    from ..runtime import cpu_packed
    from .bench_matmul import cycling
    from .timing import time_cpu

    if not rows or not copies or not cpu_packed.packs():
        return {}
    n, k = copies[0].shape
    dt = copies[0].dtype
    try:
        packed = [cpu_packed.pack_weight(w, max(rows)) for w in copies]
        cpu_packed.packed_linear(torch.zeros(1, k, dtype=dt), packed[0])
    except RuntimeError as exc:  # (oneDNN cannot pack or run the dtype on this CPU: the executor runs plain)
        log.debug("no prepacked %s products here: %s", dt, exc)
        return {}
    seconds = {}
    with torch.inference_mode():
        for m in rows:
            x = torch.randn(m, k, dtype=dt)
            seconds[m] = time_cpu(cycling(len(packed), lambda i: cpu_packed.packed_linear(x, packed[i])),
                                  COMPUTE_BUDGET_S)
    return seconds


def _dtype(dtype) -> str:
    """The dtype whose products the compute check times: the model's, else bf16."""
    return dtype_name(dtype) if dtype is not None else "bf16"


def read_floor(profile: Profile, now_bps: float, dtype=None) -> float:
    """The smallest CPU scale that leaves every one-row product of the profile in ``dtype`` (None: any)
    no faster than reading its weight at ``now_bps`` (a one-row product reads its weight once). A
    profile whose recorded read was low beside its own products would otherwise price them faster than
    memory goes: the H100 machine's profile recorded 94.7 GB/s while its one-row bf16 products read 120
    GB/s, and hosts reading 145-149 GB/s scaled its CPU times by 0.62-0.65 (the thirty-second and
    thirty-third GPU sessions). Of the model's dtype: in session 38 the fastest product of any dtype set
    the floor, an fp32 one at 138 GB/s (torch's path), and on a host reading 140 GB/s the thirty-fourth
    session planned bf16 and fp16 models with their CPU times as measured, where their own products
    allowed x0.87 and x0.77: whole CPU layers were priced 21% (llama3-8b, ``layers:2``) and 36%
    (nemo-8b, ``layers:3``) slower than they ran."""
    fastest = profile.one_row_read_bps(dtype)
    return fastest / now_bps if fastest and now_bps > 0 else 0.0


COPY_SIZE = 64 * 2**20  # the copies timed beside the CPU load (a slot fill of an 8B model's sub-layer)
COPY_LIMITS = (0.5, 3.0)


def copies_enabled() -> bool:
    """``VRAMSHARD_COPY_DRIFT``: off by default until a GPU run has measured what it does to plans."""
    return switch("VRAMSHARD_COPY_DRIFT", default=False)


def copies_corrected(profile: Profile) -> Profile:
    """``profile`` with its copies beside CPU work (contended host→device and device→host times) scaled to
    how fast host→device copies run now beside the CPU reading memory as decode does (``copy_scale``).

    The memory controller serves the CPU and the copy engine both, and how much it leaves the copies moves with
    the host's state as the CPU's own read does: H100 machines' copies kept 43 GB/s beside a CPU reading memory
    in session 51's run and 48.9 GB/s in session 53's, against 55 alone; profiles made before session 53 priced
    them at 55 beside the CPU too (their CPU load hardly read memory). Timed once per process and profile, on a
    profile of this machine with GPU data, with ``VRAMSHARD_COPY_DRIFT=on`` (about half a second and the load's
    cold weights, a few hundred MiB of host memory, while it runs); never priced faster than the profile's
    copies alone."""
    if not copies_enabled() or profile.copy_scale != 1.0 or not profile.has_gpu or not is_this_machines(profile) \
            or not gpu_here():
        return profile
    key = ("copies", profile.fingerprint_hash, str(profile.data.get("created", "")))
    with _LOCK:
        if key not in _COPIES:
            _COPIES[key] = measure_copies()
            log.info("host-to-device copies beside the CPU reading memory: %.1f GB/s now; the profile has %.1f GB/s",
                     COPY_SIZE / _COPIES[key] / 1e9, COPY_SIZE / profile.transfer_s(COPY_SIZE, "h2d", True) / 1e9)
        now_s = _COPIES[key]
    return scaled_copies(profile, now_s)


def scaled_copies(profile: Profile, now_s: float) -> Profile:
    """``profile`` with ``copy_scale`` set so that its contended ``COPY_SIZE`` host→device copy takes
    ``now_s``, within :data:`COPY_LIMITS` and no faster than its copy alone; the profile itself within
    :data:`TOLERANCE`."""
    profiled = profile.transfer_s(COPY_SIZE, "h2d", contended=True)
    scale = max(now_s / profiled, profile.transfer_s(COPY_SIZE, "h2d") / profiled)
    scale = min(max(scale, COPY_LIMITS[0]), COPY_LIMITS[1])
    if abs(math.log(scale)) <= math.log1p(TOLERANCE):
        return profile
    log.info("planning with the profile's copies beside CPU work x%.2f (timed beside the CPU reading memory now)",
             scale)
    return profile.calibrated(copy_scale=scale)


def gpu_here() -> bool:
    """Whether this process has a CUDA GPU to time copies to."""
    return torch.cuda.is_available()


def measure_copies() -> float:
    """Seconds of one ``COPY_SIZE`` pinned host→device copy while the CPU reads memory as decode does
    (:func:`~vramshard.profile.contention.cpu_load`; the median of the copies timed)."""
    from .bench_transfer import measure_transfers
    from .contention import cpu_load
    from .progress import ProgressSink

    with cpu_load():
        time.sleep(0.05)  # (the load's first products)
        table = measure_transfers([COPY_SIZE], "h2d", budget_s=0.2, progress=ProgressSink(), label="h2d beside the CPU",
                                  weight=1.0)
    return table["seconds"][0]


def forget() -> None:
    """Drop this process's checks (tests; a machine whose load changed): the next engine times again."""
    with _LOCK:
        _CHECKED.clear()
        _COMPUTED.clear()
        _COPIES.clear()
