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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..models.base import Model
from ..profile.query import Profile
from .estimator import Estimator, StepEstimate
from .planner import PlanSet

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


def step_estimate(model: Model, profile: Profile, plan: PlanSet, tier: int) -> StepEstimate:
    """The estimator's account of one step of ``tier`` of ``plan`` with ``profile`` (the planner's call)."""
    tier_plan = plan.tiers[tier]
    estimator = Estimator(model, profile, tier_plan.threads, plan.expert_hit_rate)
    return estimator.simulate(tier_plan.placement, tier, plan.context, plan.num_slots or 2)


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
