"""What engines fitted to their own steps, kept beside the machine profile for later processes.

The engine fits the profile's CPU factors by rows and its GPU dispatch factor to the steps it
measures (:mod:`vramshard.plan.calibrate`). Kept in memory only, every new process — each
``vramshard chat`` — would plan its first steps on the raw profile and fit again. This file keeps
them: ``calibration-<fingerprint hash>.json`` in the cache directory, next to
``profile-<hash>.json``::

    {"schema": 1, "fingerprint_hash": "...", "profile_created": "...",
     "factors": {"torch.bfloat16": {"cpu_rows": {"1": 1.55, "64": 1.95}, "dispatch_scale": 2.43,
                                    "split_rows": {"1": 1.3}, "updated": "2026-12-01T22:40:00Z"}}}

``split_rows`` (split FFN parts' CPU work by rows, on top of ``cpu_rows``) may be missing: none fitted.
``dispatch_pricing`` says how the estimator priced the GPU dispatch the ``dispatch_scale`` was fitted against:
:data:`DISPATCH_PRICING` since decode steps' resident runs are priced as CUDA-graph replays (session 58), absent
before, when every launch was priced eager. A ``dispatch_scale`` fitted under another pricing is not used (the CPU
factors are: they scale measured CPU work, priced alike in both).

The factors are multipliers on one profile's measurements: a profile measured again (another
``profile_created``) starts afresh, and the next fit replaces the file. Written atomically. A
file that cannot be read is reported and not used. ``VRAMSHARD_CALIBRATION_STORE=off`` keeps the
factors in memory only (the benchmarks do, so that each run starts from the profile as measured).
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

from ..env import switch
from ..paths import cache_dir
from .store import write_atomically

log = logging.getLogger(__name__)

SCHEMA = 1
DISPATCH_PRICING = 2  # 2: resident runs of decode steps priced as CUDA-graph replays; 1 (or absent): all launches eager
Rows = tuple[tuple[int, float], ...]  # (rows, factor) pairs, sorted
Factors = tuple[Rows, float, Rows]  # (cpu_rows, dispatch_scale, split_rows)


def enabled() -> bool:
    """Whether fitted factors are kept on disk (``VRAMSHARD_CALIBRATION_STORE``, on by default)."""
    return switch("VRAMSHARD_CALIBRATION_STORE", default=True)


def path(fingerprint_hash: str) -> Path:
    return cache_dir() / f"calibration-{fingerprint_hash}.json"


def read(fingerprint_hash: str, created: str, dtype: str) -> Factors | None:
    """The factors kept for this profile (its machine and when it was measured) and ``dtype``;
    None when there are none, they belong to another measurement, or the file is unreadable."""
    return read_all(fingerprint_hash, created).get(dtype)


def read_all(fingerprint_hash: str, created: str) -> dict[str, Factors]:
    """{dtype: factors} kept for this profile (empty as :func:`read` would give None)."""
    data = _read_file(path(fingerprint_hash))
    if data is None or data.get("profile_created") != created:
        return {}
    same_pricing = data.get("dispatch_pricing", 1) == DISPATCH_PRICING
    if not same_pricing:
        log.info("not using the dispatch factor in %s: fitted while the estimator priced GPU dispatch otherwise "
                 "(every launch eager); the engine fits it again", path(fingerprint_hash))
    kept = {}
    for dtype, entry in data["factors"].items():
        try:
            rows = tuple(sorted((int(r), float(f)) for r, f in entry.get("cpu_rows", {}).items()))
            split = tuple(sorted((int(r), float(f)) for r, f in entry.get("split_rows", {}).items()))
            factors = rows, float(entry.get("dispatch_scale", 1.0)) if same_pricing else 1.0, split
        except (TypeError, ValueError, AttributeError):
            log.warning("ignoring the fitted factors for %s in %s: not numbers", dtype, path(fingerprint_hash))
            continue
        if all(r >= 1 and _positive(f) for r, f in rows + split) and _positive(factors[1]):
            kept[dtype] = factors
        else:
            log.warning("ignoring the fitted factors for %s in %s: not positive numbers", dtype,
                        path(fingerprint_hash))
    return kept


def write(fingerprint_hash: str, created: str, dtype: str, factors: Factors) -> None:
    """Keep ``factors`` for this profile and ``dtype`` (those of other dtypes of the same
    measurement stay). A failure to write is logged, never raised: the engine runs on."""
    target = path(fingerprint_hash)
    data = _read_file(target, quiet=True)
    if data is None or data.get("profile_created") != created or data.get("dispatch_pricing") != DISPATCH_PRICING:
        data = {"schema": SCHEMA, "fingerprint_hash": fingerprint_hash, "profile_created": created,
                "dispatch_pricing": DISPATCH_PRICING, "factors": {}}
    rows, dispatch, split = factors
    data["factors"][dtype] = {"cpu_rows": {str(r): f for r, f in rows}, "dispatch_scale": dispatch,
                              "split_rows": {str(r): f for r, f in split},
                              "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        write_atomically(target, json.dumps(data, indent=1))
    except OSError as exc:
        log.warning("could not keep the fitted factors in %s: %s", target, exc)


def _positive(value: float) -> bool:
    return math.isfinite(value) and value > 0


def _read_file(target: Path, quiet: bool = False) -> dict | None:
    try:
        data = json.loads(target.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        if not quiet:
            log.warning("ignoring %s (fitted calibration factors): %s; the engine fits them again", target, exc)
        return None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("factors"), dict):
        if not quiet:
            log.warning("ignoring %s: not a vramshard calibration file of schema %d", target, SCHEMA)
        return None
    return data
