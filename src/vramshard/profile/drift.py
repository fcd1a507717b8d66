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

One scale for all CPU work: prompt tiers are compute-bound rather than read-bound, and the
engine's own fit of its measured steps (:mod:`vramshard.plan.calibrate`) corrects them by rows.

It runs once per process for each profile, only on a profile of this machine that recorded its
read bandwidth (same fingerprint; not a synthetic one; not one already scaled).
``VRAMSHARD_DRIFT_CHECK=off`` keeps the profile as measured.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass

import torch

from ..env import switch
from .bench_memory import measure_cpu_read
from .fingerprint import fingerprint_hash, machine_fingerprint
from .query import Profile

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


_CHECKED: dict[tuple[str, str], Drift] = {}  # (fingerprint hash, created) -> drift
_COPIES: dict[tuple[str, str, str], float] = {}  # ("copies", fingerprint hash, created) -> seconds of the copy now
_LOCK = threading.Lock()


def enabled() -> bool:
    return switch("VRAMSHARD_DRIFT_CHECK", default=True)


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
    (:func:`read_floor`); the profile itself where the check does not apply or finds it within
    :data:`TOLERANCE`."""
    if not enabled() or profile.cpu_scale != 1.0 or not profile.cpu_read_bps or not is_this_machines(profile):
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
    if abs(math.log(drift.scale)) <= math.log1p(TOLERANCE):
        return profile
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
        if within:
            return profile
        scale = floor
    elif scale == drift.scale:
        log.info("planning with the profile's CPU times x%.2f (the host reads memory %s now than when profiled)",
                 scale, "slower" if scale > 1 else "faster")
    return profile.calibrated(cpu_scale=scale)


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
        _COPIES.clear()
