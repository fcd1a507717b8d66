"""Fitting the machine profile to the decode steps the engine measures.

The profile times each piece of work alone. Inside a step, a split FFN's CPU part runs between
GPU round trips, beside the copy engine: on the H200 machine the split plans' steps took 20-40%
longer than predicted while the copies took the predicted time and stream-only plans came within
3% (docs/BENCHMARKS.md, sixth to eighth sessions). Replaying those sessions' measured plans
(``python -m benchmarks.plan_replay calibrate``) showed that one number per machine accounts for
most of it: a fixed host time each split FFN costs beyond its parts (0.5-2 ms there). Plans that
split were predicted too fast and chosen over faster ones. The host's speed also drifts by up to
20% within a session, so no one-off measurement settles it.

:func:`fit` finds that number from a running plan's measured decode step (or, for a plan that
computes on the CPU without splitting, a factor on the CPU compute times); the engine re-plans
with the :meth:`~vramshard.profile.query.Profile.calibrated` profile (``budget_follower``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..models.base import Model
from ..profile.query import Profile
from .estimator import Estimator
from .planner import PlanSet

LOWEST, HIGHEST = 0.25, 4.0  # CPU factors considered: beyond them the profile is not this machine's
MAX_SPLIT_OVERHEAD_S = 0.02  # split overheads considered
TOLERANCE = 0.01  # relative error of the fitted step time


@dataclass(frozen=True)
class Calibration:
    """What :func:`fit` changed: ``what`` ("split_overhead_s" or "cpu_scale") to ``value``, and
    the profile with it."""

    what: str
    value: float
    profile: Profile


def fit(model: Model, profile: Profile, plan: PlanSet, measured_s: float, tier: int = 1) -> Calibration | None:
    """The profile under which ``plan``'s ``tier`` step takes ``measured_s``: for a tier that
    splits FFNs and runs slower than predicted, the split overhead; otherwise, for a tier with CPU
    work, the CPU factor. None when neither changes the prediction."""
    placement = plan.tiers[tier].placement
    if placement.split_names() and measured_s > step_seconds(model, profile.calibrated(split_overhead_s=0.0), plan,
                                                               tier):
        overhead = fit_split_overhead(model, profile, plan, measured_s, tier)
        if overhead is not None:
            return Calibration("split_overhead_s", overhead, profile.calibrated(split_overhead_s=overhead))
    scale = fit_cpu_scale(model, profile, plan, measured_s, tier)
    if scale is None:
        return None
    return Calibration("cpu_scale", profile.calibrated(scale).cpu_scale, profile.calibrated(scale))


def fit_split_overhead(model: Model, profile: Profile, plan: PlanSet, measured_s: float, tier: int = 1) -> float | None:
    """The host seconds per split FFN under which the tier's step takes ``measured_s`` (bisection,
    at most :data:`MAX_SPLIT_OVERHEAD_S`). None when the tier splits nothing."""
    if measured_s <= 0 or not plan.tiers[tier].placement.split_names():
        return None
    low, high = 0.0, MAX_SPLIT_OVERHEAD_S
    for _ in range(40):
        middle = (low + high) / 2
        seconds = step_seconds(model, profile.calibrated(split_overhead_s=middle), plan, tier)
        if abs(seconds - measured_s) <= TOLERANCE * measured_s:
            return middle
        if seconds < measured_s:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def has_cpu_work(plan: PlanSet, tier: int) -> bool:
    """Whether the tier's placement computes anything on the CPU (only then does the factor matter)."""
    placement = plan.tiers[tier].placement
    return bool(placement.names(compute="cpu") or placement.split_names() or placement.expert_names("host"))


def step_seconds(model: Model, profile: Profile, plan: PlanSet, tier: int) -> float:
    """The estimator's time for one step of ``tier`` of ``plan`` with ``profile`` (the planner's call)."""
    tier_plan = plan.tiers[tier]
    estimator = Estimator(model, profile, tier_plan.threads, plan.expert_hit_rate)
    return estimator.simulate(tier_plan.placement, tier, plan.context, plan.num_slots or 2).seconds


def fit_cpu_scale(model: Model, profile: Profile, plan: PlanSet, measured_s: float, tier: int = 1) -> float | None:
    """The factor on ``profile``'s CPU compute times under which ``plan``'s ``tier`` step takes
    ``measured_s`` (bisection in log space; clamped to [LOWEST, HIGHEST]). None when the tier puts
    nothing on the CPU, or when no factor changes its predicted time."""
    if measured_s <= 0 or not has_cpu_work(plan, tier):
        return None
    low, high = LOWEST, HIGHEST
    if step_seconds(model, profile.calibrated(low), plan, tier) >= step_seconds(model, profile.calibrated(high),
                                                                                plan, tier):
        return None  # the CPU is not on the step's critical path
    for _ in range(40):
        middle = math.sqrt(low * high)
        seconds = step_seconds(model, profile.calibrated(middle), plan, tier)
        if abs(seconds - measured_s) <= TOLERANCE * measured_s:
            return middle
        if seconds < measured_s:
            low = middle
        else:
            high = middle
    return math.sqrt(low * high)
