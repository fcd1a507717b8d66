"""Fitting the machine profile to the decode steps the engine measures.

The profile times each piece of work alone. Inside a step, a split FFN's CPU part runs between
GPU round trips, beside the copy engine: on the H200 machine the split plans' steps took 20-40%
longer than predicted while the copies took the predicted time and stream-only plans came within
3% (docs/BENCHMARKS.md, sixth to eighth sessions). Replaying those sessions' measured plans
(``python -m benchmarks.plan_replay calibrate``) showed that one factor accounts for most of it:
the split FFN's CPU part runs 1.5-2x slower in the step than the profiler timed it alone. Plans
that split were predicted too fast and chosen over faster ones. The host's speed also drifts by
up to 20% within a session, so no one-off measurement settles it.

:func:`fit` finds that factor from a running plan's measured decode step (or, for a plan that
computes on the CPU without splitting, a factor on all CPU compute times); the engine re-plans
with the :meth:`~vramshard.profile.query.Profile.calibrated` profile (``budget_follower``).

Since the tenth GPU session the executor times the CPU work itself (``StepReport.host_compute_s``),
so :func:`fit_cpu_rows` fits it directly, per tier: a factor on CPU compute at that many rows. It
grows with the rows on the H200 machine (1.17-1.6 at one row, 1.4 at 1024), which one factor for
all tiers could not follow.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable

from ..models.base import Model
from ..profile import learned as learned_store
from ..profile.query import Profile
from .estimator import Estimator, StepEstimate
from .planner import PlanSet

log = logging.getLogger(__name__)

LOWEST, HIGHEST = 0.25, 8.0  # factors considered: beyond them the profile is not this machine's
TOLERANCE = 0.01  # relative error of the fitted step time


@dataclass(frozen=True)
class Calibration:
    """What :func:`fit` changed: ``what`` ("split_part_scale" or "cpu_scale") to ``value`` (the
    profile's factor, composed with any earlier one), and the profile with it."""

    what: str
    value: float
    profile: Profile


def fit(model: Model, profile: Profile, plan: PlanSet, measured_s: float, tier: int = 1) -> Calibration | None:
    """The profile under which ``plan``'s ``tier`` step takes ``measured_s``: for a tier that
    splits FFNs, the factor on their CPU parts; otherwise, or when that factor cannot explain the
    step, the factor on all CPU compute. None when neither can (the gap lies elsewhere: then the
    profile is left as it is)."""
    if plan.tiers[tier].placement.split_names():
        scale = _bisect(model, plan, tier, measured_s, lambda f: profile.calibrated(split_part_scale=f))
        if scale is not None:
            fitted = profile.calibrated(split_part_scale=scale)
            return Calibration("split_part_scale", fitted.split_part_scale, fitted)
    scale = fit_cpu_scale(model, profile, plan, measured_s, tier)
    if scale is None:
        return None
    fitted = profile.calibrated(scale)
    return Calibration("cpu_scale", fitted.cpu_scale, fitted)


def has_cpu_work(plan: PlanSet, tier: int) -> bool:
    """Whether the tier's placement computes anything on the CPU (only then does the factor matter)."""
    placement = plan.tiers[tier].placement
    return bool(placement.names(compute="cpu") or placement.split_names() or placement.expert_names("host"))


def step_estimate(model: Model, profile: Profile, plan: PlanSet, tier: int, context: int | None = None) -> StepEstimate:
    """The estimator's account of one step of ``tier`` of ``plan`` with ``profile`` (the planner's
    call), at ``context`` positions (None: the plan's)."""
    tier_plan = plan.tiers[tier]
    estimator = Estimator(model, profile, tier_plan.threads, plan.expert_hit_rate,
                          zero_copy_cpu_share=tier_plan.zero_copy_cpu_share)
    return estimator.simulate(tier_plan.placement, tier, plan.context if context is None else context,
                              plan.num_slots or 2)


def step_seconds(model: Model, profile: Profile, plan: PlanSet, tier: int) -> float:
    """The estimator's time for one step of ``tier`` of ``plan`` with ``profile``."""
    return step_estimate(model, profile, plan, tier).seconds


def fit_cpu_scale(model: Model, profile: Profile, plan: PlanSet, measured_s: float, tier: int = 1) -> float | None:
    """The factor on ``profile``'s CPU compute times under which ``plan``'s ``tier`` step takes
    ``measured_s``. None when the tier puts nothing on the CPU, or when no factor in
    [LOWEST, HIGHEST] explains the measured time."""
    if not has_cpu_work(plan, tier):
        return None
    return _bisect(model, plan, tier, measured_s, profile.calibrated)


def _bisect(model: Model, plan: PlanSet, tier: int, measured_s: float, scaled) -> float | None:
    """The factor in [LOWEST, HIGHEST] under which ``scaled(factor)``'s prediction of the step is
    ``measured_s`` (bisection in log space). None when no factor in that range explains it: the
    work it scales is not on the step's critical path, or too small a part of it."""
    if measured_s <= 0:
        return None
    low, high = LOWEST, HIGHEST
    if not step_seconds(model, scaled(low), plan, tier) <= measured_s <= step_seconds(model, scaled(high), plan, tier):
        return None
    for _ in range(40):
        middle = math.sqrt(low * high)
        seconds = step_seconds(model, scaled(middle), plan, tier)
        if abs(seconds - measured_s) <= TOLERANCE * measured_s:
            return middle
        if seconds < measured_s:
            low = middle
        else:
            high = middle
    return math.sqrt(low * high)


# ---------------------------------------------------------------------------- CPU work as measured
CPU_OFF_BY = 1.15  # measured / predicted CPU work of a tier beyond which it is fitted
MIN_CPU_S = 0.002  # a tier's predicted CPU work below this is launch overhead, not fitted


def scale_points(planned: int, least: int = 1) -> list[int]:
    """The contexts at which :func:`context_scale` wants the estimator's step (of ``least`` new
    tokens: its context is at least that)."""
    return sorted({min(max(least, c), planned) for c in (1, planned // 8, planned // 2, planned)})


def context_scale(steps: dict[int, float], planned: int) -> Callable[[int], float] | None:
    """context -> the factor taking a step at that context to the ``planned`` one, from the
    estimator's step seconds at the contexts of :func:`scale_points` (``steps``: {context: seconds}),
    linear in between and beyond the last two. None when the estimates cannot say."""
    points = sorted(steps.items())
    if planned not in steps or len(points) < 2 or any(not seconds > 0 for _, seconds in points):
        return None
    at_planned = steps[planned]

    def to_planned(context: int) -> float:
        i = next((k for k in range(1, len(points) - 1) if context <= points[k][0]), len(points) - 1)
        (c0, s0), (c1, s1) = points[i - 1], points[i]
        return at_planned / max(s0 + (s1 - s0) * (context - c0) / (c1 - c0), points[0][1])

    return to_planned


def by_context(model: Model, profile: Profile, plan: PlanSet, tier: int,
               cpu_rest: bool = False) -> Callable[[int], float] | None:
    """:func:`context_scale` of ``plan``'s ``tier`` step by the estimator: its whole step, or
    (``cpu_rest``) its CPU work other than split FFN parts (which read no context)."""
    if tier not in plan.tiers:
        return None
    estimates = {c: step_estimate(model, profile, plan, tier, context=c) for c in scale_points(plan.context, tier)}
    return context_scale({c: e.cpu_busy - e.cpu_split_busy if cpu_rest else e.seconds for c, e in estimates.items()},
                         plan.context)


def cpu_seconds(model: Model, profile: Profile, plan: PlanSet, tier: int) -> float:
    """The estimator's host time computing ``tier``'s CPU work in one step of ``plan``."""
    return step_estimate(model, profile, plan, tier).cpu_busy


def fit_cpu_rows(model: Model, profile: Profile, plan: PlanSet, measured: dict[int, float],
                 split: dict[int, float] | None = None) -> Calibration | None:
    """The profile under which each tier's CPU work in ``plan`` takes what the executor measured
    (``measured``: tier -> median host seconds of its CPU work per step): a factor on CPU compute
    at that many rows (:meth:`Profile.calibrated` ``cpu_rows``), for the tiers more than
    CPU_OFF_BY off. None when every tier is within it (or has too little CPU work to judge, or
    is off by more than any factor in [LOWEST, HIGHEST] explains).

    ``split``: tier -> of those seconds, the host's time in split FFNs' CPU parts. Where a tier has
    them, the rest of its CPU work (whole sub-layers and experts on the CPU) is fitted by
    ``cpu_rows`` and then the split parts by ``split_rows``, on top. On the H200 machine split parts
    ran 1.6x their prediction while 15 whole layers on the CPU ran as predicted (docs/BENCHMARKS.md,
    fifteenth session); one factor for both made the planner price whole CPU layers 1.6x too high.

    The measurement is the host's own time in the CPU work, so no search over the whole step is
    needed: the factor on the work's compute (its launches stay as profiled) solved by a few secant
    steps, the CPU time being close to linear in it."""
    rows: dict[int, float] = {}
    split_rows: dict[int, float] = {}
    for tier, seconds in sorted(measured.items()):
        if tier not in plan.tiers or seconds <= 0:
            continue
        estimate = step_estimate(model, profile, plan, tier)
        in_parts = (split or {}).get(tier, 0.0)
        if in_parts <= 0 or estimate.cpu_split_busy <= 0:  # the CPU work as one
            factor = _fit_one(tier, "CPU work", seconds, estimate.cpu_busy,
                              lambda f: cpu_seconds(model, profile.calibrated(cpu_rows={tier: f}), plan, tier))
            if factor is not None:
                rows[tier] = factor
            continue
        factor = _fit_one(tier, "CPU work beside the split FFN parts", seconds - in_parts,
                          estimate.cpu_busy - estimate.cpu_split_busy,
                          lambda f: _rest_seconds(model, profile.calibrated(cpu_rows={tier: f}), plan, tier))
        base = profile
        if factor is not None:
            rows[tier] = factor
            base = profile.calibrated(cpu_rows={tier: factor})
        def parts_seconds(f: float) -> float:
            return step_estimate(model, base.calibrated(split_rows={tier: f}), plan, tier).cpu_split_busy

        parts = _fit_one(tier, "split FFN parts' CPU work", in_parts, parts_seconds(1.0), parts_seconds)
        if parts is not None:
            split_rows[tier] = parts
    if not rows and not split_rows:
        return None
    fitted = profile.calibrated(cpu_rows=rows, split_rows=split_rows)
    what = "+".join(name for name, table in (("cpu_rows", rows), ("split_rows", split_rows)) if table)
    return Calibration(what, dict(fitted.cpu_rows), fitted)


def _rest_seconds(model: Model, profile: Profile, plan: PlanSet, tier: int) -> float:
    """The estimator's host time in ``tier``'s CPU work other than split FFN parts."""
    estimate = step_estimate(model, profile, plan, tier)
    return estimate.cpu_busy - estimate.cpu_split_busy


def _fit_one(tier: int, what: str, seconds: float, predicted: float, seconds_at) -> float | None:
    """The factor f with ``seconds_at(f) == seconds`` (``predicted``: its value at 1), or None when
    ``predicted`` is too little work to judge, the two are within CPU_OFF_BY, or no factor in
    [LOWEST, HIGHEST] explains ``seconds``."""
    if predicted < MIN_CPU_S or seconds <= 0 or 1 / CPU_OFF_BY <= seconds / predicted <= CPU_OFF_BY:
        return None
    factor = _secant(seconds_at, seconds, predicted)
    if factor in (LOWEST, HIGHEST):
        # No factor considered explains it: an outlier (a step the host was busy in) or a profile
        # of another machine. Fitted at the limit, it would spread to the other tiers' rows.
        log.info("the %s of tier %d took %.1f ms where %.1f ms was predicted: beyond the factors considered "
                 "(%g-%g), not fitted", what, tier, seconds * 1e3, predicted * 1e3, LOWEST, HIGHEST)
        return None
    return factor


def fit_dispatch(model: Model, profile: Profile, plan: PlanSet, measured_s: float, tier: int = 1) -> Calibration | None:
    """The profile under which ``plan``'s ``tier`` step takes ``measured_s`` by a factor on the
    host's cost of dispatching GPU work (launches, ring fills, the Python around them), for a plan
    whose CPU work was already fitted from its own timing. None when no factor in [LOWEST,
    HIGHEST] explains the step (the dispatch is not on its critical path: a copy-bound step)."""
    scale = _bisect(model, plan, tier, measured_s, lambda f: profile.calibrated(dispatch_scale=f))
    if scale is None:
        return None
    fitted = profile.calibrated(dispatch_scale=scale)
    return Calibration("dispatch_scale", fitted.dispatch_scale, fitted)


def fit_measured(model: Model, profile: Profile, plan: PlanSet, tier: int, measured_s: float,
                 host_compute_s: float, host_split_s: float = 0.0) -> Calibration | None:
    """Both of the engine's fits for one measured step of ``tier``: the CPU factor at its rows from
    the host's own time in the CPU work (:func:`fit_cpu_rows`), then the host's GPU dispatch from
    the rest of the step (:func:`fit_dispatch`). ``value``: {"cpu_rows": ..., "dispatch_scale":
    ...} of what was fitted. None when the step needs neither (within the tolerances)."""
    fitted, value = profile, {}
    cpu = fit_cpu_rows(model, profile, plan, {tier: host_compute_s}, {tier: host_split_s}) \
        if host_compute_s > 0 else None
    if cpu is not None:
        fitted, value["cpu_rows"] = cpu.profile, cpu.value
        if cpu.profile.split_rows:
            value["split_rows"] = dict(cpu.profile.split_rows)
    predicted = step_seconds(model, fitted, plan, tier)
    if not 1 / CPU_OFF_BY <= measured_s / predicted <= CPU_OFF_BY:
        dispatch = fit_dispatch(model, fitted, plan, measured_s, tier)
        if dispatch is not None:
            fitted, value["dispatch_scale"] = dispatch.profile, dispatch.value
    if not value:
        return None
    return Calibration("+".join(value), value, fitted)


# What engines of this process measured, for the next engine on the same machine profile and dtype:
# (profile fingerprint, measured when, dtype) -> (the fitted cpu_rows, dispatch_scale, split_rows),
# all on the profile as measured. Kept on disk too, for later processes (profile/learned.py).
_LEARNED: dict[tuple[str, str, str], learned_store.Factors] = {}


def tiers_fitted_since(now: Profile, then: Profile, tiers) -> set[int]:
    """Of ``tiers``, those whose CPU work ``now`` prices by a factor fitted since ``then``: its own entry in
    the CPU factors by rows or the split parts' (:func:`fit_cpu_rows`) differs."""
    return {tier for tier in tiers if dict(now.cpu_rows).get(tier) != dict(then.cpu_rows).get(tier)
            or dict(now.split_rows).get(tier) != dict(then.split_rows).get(tier)}


def with_row_factors_of(profile: Profile, fitted: Profile, tiers) -> Profile:
    """``profile`` with ``fitted``'s own entries at ``tiers`` in its CPU factors by rows and the split
    parts' (an entry ``fitted`` lacks is dropped); every other factor stays ``profile``'s."""
    factors, theirs = profile.fitted_factors(), fitted.fitted_factors()
    for key in ("cpu_rows", "split_rows"):
        table, source = dict(map(tuple, factors[key])), dict(map(tuple, theirs[key]))
        for tier in tiers:
            if tier in source:
                table[tier] = source[tier]
            else:
                table.pop(tier, None)
        factors[key] = sorted(table.items())
    return profile.with_fitted_factors(factors)


def _key(profile: Profile, dtype) -> tuple[str, str, str] | None:
    """One measured profile (its machine and when it was measured) and a dtype; None for a
    synthetic profile, which no machine measured."""
    data = profile.to_dict()
    if data.get("synthetic") or not data.get("fingerprint_hash"):
        return None
    return data["fingerprint_hash"], str(data.get("created")), str(dtype)


def learn(profile: Profile, dtype) -> None:
    """Keep ``profile``'s fitted ``cpu_rows``, ``dispatch_scale`` and ``split_rows`` for later
    engines with ``dtype``: of this process, and of later ones through the calibration file. They
    replace what was kept before, none included (a revert gave up the fits kept before: later engines
    of an ABBA benchmark started from a dispatch fit their predecessor had reverted)."""
    key = _key(profile, dtype)
    fitted = bool(profile.cpu_rows or profile.split_rows or profile.dispatch_scale != 1.0)
    if key is None or not (fitted or key in _LEARNED):
        return
    _LEARNED[key] = (profile.cpu_rows, profile.dispatch_scale, profile.split_rows)
    if learned_store.enabled():
        learned_store.write(*key, _LEARNED[key])


def with_learned(profile: Profile, dtype) -> Profile:
    """``profile`` with the factors an earlier engine fitted on it for ``dtype``, in this process
    or (from the calibration file) in an earlier one. The profile itself when none did, or when
    it carries fitted factors already."""
    key = _key(profile, dtype)
    if key is None or profile.cpu_rows or profile.split_rows or profile.dispatch_scale != 1.0:
        return profile
    learned = _LEARNED.get(key)
    if learned is None and learned_store.enabled():
        learned = learned_store.read(*key)
        if learned is not None:
            _LEARNED[key] = learned
            log.info("starting from the factors fitted in an earlier run on this machine profile: CPU by rows %s, "
                     "split FFN parts by rows %s, dispatch %.3g (%s)", dict(learned[0]), dict(learned[2]), learned[1],
                     learned_store.path(key[0]))
    if not learned:
        return profile
    rows, dispatch, split = learned
    return profile.calibrated(cpu_rows=dict(rows), dispatch_scale=dispatch, split_rows=dict(split))


def forget_learned() -> None:
    """Drop what engines of this process fitted (tests, or a machine whose load changed); the
    calibration file stays (delete it, or measure the profile again, to start afresh)."""
    _LEARNED.clear()


def _secant(seconds_at, target: float, at_one: float) -> float:
    """The factor f in [LOWEST, HIGHEST] with ``seconds_at(f) == target`` (``at_one``: its value at 1)."""
    f0, s0 = 1.0, at_one
    f1 = min(max(target / at_one, LOWEST), HIGHEST)
    for _ in range(6):
        s1 = seconds_at(f1)
        if abs(s1 - target) <= TOLERANCE * target or s1 == s0:
            break
        f0, s0, f1 = f1, s1, min(max(f1 + (target - s1) * (f1 - f0) / (s1 - s0), LOWEST), HIGHEST)
    return f1
