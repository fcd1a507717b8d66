"""Decode steps as measured against the plan's prediction for them.

The planner chooses placements from the machine profile's predicted step times. A profile from
another machine, or one measured while the machine was busy, predicts wrongly, and the plans it
picks are then not the fastest. A single sequence's decode step is the one step whose predicted
time (the plan's smallest tier) can be compared with the measured one, so a
:class:`DecodeCheck` collects those steps' forward times for the plan in force and says, once,
when their median is far from the prediction.

The plan predicts its step at the context it reserves, and steps run at every context from a
prompt's end on: each step's time is taken to that context first, by the estimator's account of how
the step grows with its context (``to_planned``, from
:func:`~vramshard.plan.calibrate.by_context`). Without that, medians of steps at a few hundred
tokens were compared with predictions at thousands, and two plans' medians from different
contexts with each other (docs/BENCHMARKS.md, thirty-first GPU session).
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from typing import Callable

log = logging.getLogger(__name__)

MIN_STEPS = 32  # single-sequence decode steps measured before the median is judged
WINDOW = 256  # most recent steps kept
OFF_BY = 1.5  # measured / predicted beyond this factor (either way) is worth a warning


class DecodeCheck:
    """Single-sequence decode steps of the plan ``plan_name``, predicted at ``predicted_s`` each
    (None: no prediction to check against). ``plan``: the plan object checked (the caller's key).
    ``to_planned``: context -> the factor that takes a step at that context to the plan's (None:
    steps are taken as they are)."""

    def __init__(self, plan_name: str, predicted_s: float | None, tier: int = 1, plan: object = None,
                 to_planned: Callable[[int], float] | None = None):
        self.plan_name = plan_name
        self.plan = plan
        self.predicted_s = predicted_s
        self.tier = tier
        self.to_planned = to_planned
        self.measured: deque[float] = deque(maxlen=WINDOW)  # forward seconds of the steps, at the plan's context
        self.raw: deque[float] = deque(maxlen=WINDOW)  # the same steps' forward seconds as measured
        self.warned = False
        self.calibrated = False  # the profile was fitted to this plan's steps (budget_follower)

    def add(self, tokens: int, sequences: int, forward_s: float, context: int = 0) -> None:
        """One step of ``tokens`` new tokens over ``sequences`` sequences, ``forward_s`` in the model,
        attending over ``context`` positions (0: unknown, taken as the plan's)."""
        if tokens != 1 or sequences != 1 or self.predicted_s is None:
            return
        self.raw.append(forward_s)
        self.measured.append(forward_s * (self.to_planned(context) if context and self.to_planned else 1.0))
        if not self.warned and len(self.measured) >= MIN_STEPS:
            ratio = self.ratio()
            if ratio > OFF_BY or ratio < 1 / OFF_BY:
                self.warned = True
                log.warning("decode steps take %.1f ms (median of %d) where plan %s predicted %.1f ms (%.2fx): "
                            "the machine profile does not fit this machine as it runs now, so the plan may not "
                            "be the fastest; re-run `vramshard profile` on this machine", self.median_s() * 1e3,
                            len(self.measured), self.plan_name, self.predicted_s * 1e3, ratio)

    def median_s(self) -> float | None:
        return statistics.median(self.measured) if self.measured else None

    def ratio(self) -> float | None:
        """Median measured / predicted (None before any step)."""
        median = self.median_s()
        return median / self.predicted_s if median is not None and self.predicted_s else None

    def summary(self) -> dict:
        median, ratio = self.median_s(), self.ratio()
        raw = statistics.median(self.raw) if self.raw else None
        return {"plan": self.plan_name, "tier": self.tier, "steps": len(self.measured),
                "predicted_ms": None if self.predicted_s is None else self.predicted_s * 1e3,
                "measured_median_ms": None if raw is None else raw * 1e3,
                "at_planned_context_ms": None if median is None else median * 1e3, "measured_over_predicted": ratio}


def cpu_samples_needed(tier: int) -> int:
    """Steps of a tier whose CPU work is measured before it is judged (after its first,
    :meth:`CpuCheck.add`): a prompt chunk's CPU part runs for tens of milliseconds and one is
    enough; a decode tier's few milliseconds vary more."""
    return 1 if tier >= 256 else 8


class CpuCheck:
    """The host's time computing each tier's CPU work (CPU sub-layers, split FFNs' CPU parts,
    experts on the CPU: ``StepReport.host_compute_s``) in the steps of the plan ``plan``. The
    estimator predicts that time from the profile, which times each piece alone; inside a step it
    has run 1.25-1.4x longer at one token and more at prompt chunks on the H200 machine
    (docs/BENCHMARKS.md), so the engine fits the profile to it (budget_follower)."""

    def __init__(self, plan: object, judged: set[int] | None = None,
                 to_planned: Callable[[int, int], float] | None = None):
        self.plan = plan
        # (tier, context) -> the factor taking that tier's CPU work at that context to the plan's
        # context (see DecodeCheck), or None: taken as they are
        self.to_planned = to_planned
        self.samples: dict[int, deque[float]] = {}
        self.split_samples: dict[int, deque[float]] = {}  # of each sample, the split FFNs' CPU parts
        # Tiers already fitted (or found in tolerance), shared with the engine's earlier checks.
        self.judged: set[int] = judged if judged is not None else set()
        self.warmed: set[int] = set()  # tiers whose first step under this plan has run

    def add(self, tier: int, host_compute_s: float, host_split_s: float = 0.0, context: int = 0) -> None:
        """One step of ``tier`` whose CPU work took ``host_compute_s``, ``host_split_s`` of it in
        split FFNs' CPU parts (steps without CPU work are not kept), attending over ``context``
        positions (0: unknown, taken as the plan's). The split parts do not read the context; the
        rest is taken to the plan's context as :class:`DecodeCheck` takes its steps.

        A tier's first step under the plan is not kept either: it pays the plan's first calls
        (kernel choices, caches, first touches). On the H200 machine an engine's first 1024-token
        step spent 253 ms in CPU work that took 16 ms in the next engine's, and fitting it put
        every tier's CPU factor at the largest considered (docs/BENCHMARKS.md, fifteenth session)."""
        if host_compute_s <= 0 or tier in self.judged:
            return
        if tier not in self.warmed:
            self.warmed.add(tier)
            return
        split = min(host_split_s, host_compute_s)
        if context and self.to_planned is not None:
            host_compute_s = split + (host_compute_s - split) * self.to_planned(tier, context)
        self.samples.setdefault(tier, deque(maxlen=WINDOW)).append(host_compute_s)
        self.split_samples.setdefault(tier, deque(maxlen=WINDOW)).append(split)

    def steps_to_judge(self, tier: int) -> int:
        """Steps of ``tier`` with CPU work still to run before it is judged: its first under the plan, if
        not yet run, and the samples it lacks (0: judged, or to be at the next poll)."""
        if tier in self.judged:
            return 0
        return (tier not in self.warmed) + max(0, cpu_samples_needed(tier) - len(self.samples.get(tier, ())))

    def ready(self) -> dict[int, float]:
        """{tier: median seconds of its CPU work} of the tiers not judged yet with enough steps."""
        return {tier: statistics.median(times) for tier, times in self.samples.items()
                if tier not in self.judged and len(times) >= cpu_samples_needed(tier)}

    def split_of(self, tiers) -> dict[int, float]:
        """{tier: median seconds of its split FFNs' CPU parts} for ``tiers`` (those :meth:`ready` gave)."""
        return {tier: statistics.median(self.split_samples[tier]) for tier in tiers if tier in self.split_samples}
