"""The run-ahead worker's OpenMP team, chosen from the worker's own time in the engine's steps.

A team as large as the cores left beside the host thread is the fastest on a quiet host, and the
one that suffers most on a busy one: each of its barriers waits for its slowest thread, and a
thread that shares its core with other work (a game beside the engine, the system) holds the whole
team up. In the thirty-sixth GPU session (docs/BENCHMARKS.md; qwen3-30b-a3b, experts-cpu, a
16-core host reading memory at 60-107 GB/s) a team of 15 ran its step's expert passes in 55-89 ms
in four runs and 149-244 ms in four others; teams of 12-14 took 54-71 ms in all five of theirs.
The profile times teams once, on a quiet machine; how busy the cores are is a thing of the moment.

So the executor times the worker's computing in each step (:class:`TeamTuner`), by the step's token
count (the same work step after step while decoding), and now and then runs a few steps with a
neighbouring team: a smaller one first, a larger one next. A neighbour clearly faster (by
``MARGIN``) is kept; one that is not is tried again after twice as long (up to ``LONGEST_HOLD``
steps). A team whose time grows past ``COLLAPSE`` times what it took when it was taken is
tried against a smaller one at once. The teams considered lie between half the largest team and
the largest (:func:`~vramshard.runtime.run_ahead.largest_team`), or from the plan's team where the plan
took a smaller one; ``VRAMSHARD_WORKER_THREADS``
fixes the team instead, and ``VRAMSHARD_WORKER_TEAM_TUNING=off`` keeps the plan's.

This module is plain bookkeeping: it runs nothing and owns no thread.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field

from ..env import switch

log = logging.getLogger(__name__)

ENABLED = switch("VRAMSHARD_WORKER_TEAM_TUNING", True)

SAMPLES = 6  # steps that time a team (its median)
HOLD = 128  # steps between trials of a neighbouring team (doubled after each trial that lost)
LONGEST_HOLD = 2048
MARGIN = 0.05  # a neighbour is taken when its median is this much shorter than the team's
COLLAPSE = 1.5  # the team's recent median over its median when taken: try a smaller team now
MIN_SECONDS = 2e-4  # steps whose worker computed less than this say nothing about its team


@dataclass
class _Tokens:
    """The tuning of steps of one token count."""

    largest: int  # the teams considered: smallest..largest, by stride
    smallest: int
    stride: int
    team: int  # the team taken
    taken_s: float | None = None  # its median over the first SAMPLES steps after it was taken
    recent: list[float] = field(default_factory=list)  # its last SAMPLES steps
    trial: int | None = None  # the neighbour on trial, if any
    trial_samples: list[float] = field(default_factory=list)
    reference_s: float = 0.0  # the team's median when the trial began
    held: int = 0  # steps with the team since it was taken or last tried against a neighbour
    hold: int = HOLD
    direction: int = -1  # the next trial's neighbour: smaller (-1) or larger (+1)


class TeamTuner:
    """Which team the worker's parts of a step get, from the worker's computing in earlier steps.

    Per step: :meth:`team` before it, :meth:`observe` after it with the seconds the worker spent
    computing its parts. :meth:`reset` when the plan changes (other work per step)."""

    def __init__(self):
        self._by_tokens: dict[int, _Tokens] = {}

    def reset(self) -> None:
        """Forget every timing (a new plan: other work in each step)."""
        self._by_tokens.clear()

    def team(self, tokens: int, planned: int | None, largest: int) -> int:
        """The team for the worker's parts of the next step of ``tokens`` tokens, of at most
        ``largest`` threads (:func:`~vramshard.runtime.run_ahead.largest_team` of the step's), the plan's
        ``planned`` team (None: the largest) being where the tuning of that token count starts."""
        state = self._by_tokens.get(tokens)
        if state is None:
            if largest < 1:
                raise ValueError(f"the largest team must be 1 thread or more, got {largest}")
            start = largest if planned is None else max(1, min(planned, largest))
            # (a plan's smaller team is its choice, kept within reach: the team never goes below it or half the largest)
            smallest = max(1, min(largest // 2, start))
            stride = max(1, round(largest / 8))  # 15 threads: teams 15, 13, 11, 9 (and 7, the smallest)
            # (the first trial soon: a team collapsed from the start is never COLLAPSE times itself)
            state = self._by_tokens[tokens] = _Tokens(largest, smallest, stride, team=start, hold=2 * SAMPLES)
        return state.trial if state.trial is not None else state.team

    def teams(self) -> dict[int, int]:
        """{token count: the team taken for its steps} (trials aside)."""
        return {tokens: state.team for tokens, state in sorted(self._by_tokens.items())}

    def on_trial(self, tokens: int) -> bool:
        """Whether the next step of ``tokens`` tokens runs a neighbouring team on trial (its times are
        the trial's, not the team's the engine goes on with)."""
        state = self._by_tokens.get(tokens)
        return state is not None and state.trial is not None

    def observe(self, tokens: int, team: int, seconds: float) -> None:
        """The worker computed for ``seconds`` in a step of ``tokens`` tokens whose parts ran with
        ``team`` threads."""
        state = self._by_tokens.get(tokens)
        if state is None or seconds < MIN_SECONDS:
            return
        if state.trial is not None:
            if team == state.trial:
                state.trial_samples.append(seconds)
                if len(state.trial_samples) >= SAMPLES:
                    self._judge(tokens, state)
            return
        if team != state.team:
            return  # (a step begun before the last change)
        state.recent = (state.recent + [seconds])[-SAMPLES:]
        state.held += 1
        if len(state.recent) < SAMPLES:
            return
        median = statistics.median(state.recent)
        if state.taken_s is None:
            state.taken_s = median
        if median > COLLAPSE * state.taken_s and _neighbour(state, state.team, -1) is not None:
            log.info("run-ahead worker: its %d-token steps' CPU parts took %.1f ms at %d threads, %.1fx the %.1f ms "
                     "when that team was taken: trying a smaller team", tokens, median * 1e3, state.team,
                     median / state.taken_s, state.taken_s * 1e3)
            self._begin_trial(state, -1, median)
        elif state.held >= state.hold:
            self._begin_trial(state, state.direction, median)

    def _begin_trial(self, state: _Tokens, direction: int, reference_s: float) -> None:
        other = _neighbour(state, state.team, direction)
        if other is None:
            direction = -direction
            other = _neighbour(state, state.team, direction)
        state.held = 0
        if other is None:  # (a team of one thread: nothing to try)
            state.hold = LONGEST_HOLD
            return
        state.direction = direction
        state.trial, state.trial_samples, state.reference_s = other, [], reference_s

    def _judge(self, tokens: int, state: _Tokens) -> None:
        median = statistics.median(state.trial_samples)
        trial, state.trial = state.trial, None
        if median < (1 - MARGIN) * state.reference_s:
            log.info("run-ahead worker: its %d-token steps' CPU parts took %.1f ms at %d threads against %.1f ms at "
                     "%d: taking %d", tokens, median * 1e3, trial, state.reference_s * 1e3, state.team, trial)
            state.team, state.taken_s, state.recent, state.hold = trial, None, [], HOLD
        else:
            state.direction, state.hold = -state.direction, min(2 * state.hold, LONGEST_HOLD)
        state.held = 0


def _neighbour(state: _Tokens, team: int, direction: int) -> int | None:
    other = min(max(team + direction * state.stride, state.smallest), state.largest)
    return None if other == team else other
