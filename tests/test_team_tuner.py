"""The run-ahead worker's team, tuned from its own times (runtime/team_tuner.py)."""

import random

import pytest

from vramshard.runtime import team_tuner
from vramshard.runtime.team_tuner import HOLD, LONGEST_HOLD, SAMPLES, TeamTuner


def run(tuner: TeamTuner, seconds_at, steps: int, tokens: int = 1, planned=None, start: int = 0,
        largest: int = 15) -> list[int]:
    """``steps`` steps of ``tokens`` tokens, the worker computing for ``seconds_at(team, step)``; the
    team of each step."""
    teams = []
    for step in range(start, start + steps):
        team = tuner.team(tokens, planned, largest)
        teams.append(team)
        tuner.observe(tokens, team, seconds_at(team, step))
    return teams


def quiet(team: int, step: int) -> float:
    """Memory-bound work on a quiet host: more threads read faster (the H100 host's profile:
    15 threads 202.8 GB/s, 12 178.4, 8 142.1)."""
    return 0.050 * 15 / min(team, 15) ** 0.6 / 15 ** 0.4


def test_a_team_that_collapses_is_left_for_a_smaller_one_soon():
    """The thirty-sixth GPU session: a team of 15 ran 55-89 ms a step or 149-244; 12-14 ran 54-71."""
    collapse_at = 300

    def busy(team: int, step: int) -> float:
        if team >= 15 and step >= collapse_at:
            return 0.230
        return quiet(team, step) * (1.1 if team < 15 else 1.0)

    tuner = TeamTuner()
    teams = run(tuner, busy, 600)
    assert set(teams[200:collapse_at]) == {15} or teams[collapse_at - 1] == 15  # quiet: the largest kept
    assert teams[collapse_at + 3 * SAMPLES] < 15, "still on the collapsed team"
    assert teams[-1] in (13, 11) and all(t < 15 for t in teams[collapse_at + 3 * SAMPLES:])
    # the way back is tried, less and less often, while the collapse lasts
    assert teams[collapse_at + 3 * SAMPLES:].count(15) <= 2 * SAMPLES


def test_on_a_quiet_host_the_largest_team_stays_and_the_trials_grow_rare():
    tuner = TeamTuner()
    teams = run(tuner, quiet, 4000)
    assert teams[-1] == 15
    trials = sum(1 for a, b in zip(teams, teams[1:]) if a == 15 and b != 15)
    assert trials <= 9, f"{trials} trials of a smaller team in 4000 steps"  # (each lost: the next after twice as long)
    assert teams.count(15) >= 0.98 * len(teams)
    assert tuner._by_tokens[1].hold == LONGEST_HOLD


def test_a_smaller_planned_team_climbs_to_a_faster_larger_one():
    tuner = TeamTuner()
    teams = run(tuner, quiet, 1500, planned=9)
    assert teams[0] == 9 and teams[-1] == 15


def test_a_plans_team_below_half_the_largest_is_where_the_tuning_starts_and_its_floor():
    """A plan that took 2 of 15 threads (the CPU's other work wants the rest): the tuner starts at 2 and
    never goes below it; it climbs only where larger teams are faster."""
    def slower_with_more(team: int, step: int) -> float:
        return 0.010 * team

    tuner = TeamTuner()
    teams = run(tuner, slower_with_more, 800, planned=2)
    assert teams[0] == 2 and min(teams) == 2 and teams[-1] == 2
    assert set(teams) == {2, 4}  # (its one neighbour, tried and left)
    climbing = TeamTuner()
    assert run(climbing, quiet, 1500, planned=2)[-1] == 14  # (15 reads under MARGIN faster than 14)


def test_the_steps_of_a_trial_are_told_apart():
    tuner = TeamTuner()
    trials = []
    for step in range(390):
        team = tuner.team(1, None, 15)
        trials.append(tuner.on_trial(1))
        assert trials[-1] == (team != tuner._by_tokens[1].team)
        tuner.observe(1, team, quiet(team, step))
    # trials after holds of 12, 24, 48 and 96 steps (each lost: the hold doubles), the next after 192 more
    assert trials[2 * SAMPLES:3 * SAMPLES] == [True] * SAMPLES and sum(trials) == 4 * SAMPLES
    assert not tuner.on_trial(4)


def test_a_team_collapsed_from_the_first_step_is_left_within_a_few_trials():
    tuner = TeamTuner()
    teams = run(tuner, lambda team, step: 0.240 if team >= 15 else 0.060, 100)
    assert teams[0] == 15 and teams[-1] < 15
    assert teams.index(13) <= 2 * SAMPLES + 1


def test_noise_alone_moves_no_team_far():
    rng = random.Random(7)
    tuner = TeamTuner()
    teams = run(tuner, lambda team, step: 0.050 * rng.uniform(0.97, 1.03), 5000)
    assert min(teams[-HOLD:]) >= 13


def test_each_token_count_is_tuned_on_its_own_and_a_new_plan_forgets():
    tuner = TeamTuner()
    run(tuner, lambda team, step: 0.240 if team >= 15 else 0.060, 100, tokens=1)
    assert tuner.team(1, None, 15) < 15 and tuner.team(4, None, 15) == 15
    assert tuner.teams() == {1: tuner.team(1, None, 15), 4: 15}
    tuner.reset()
    assert tuner.team(1, None, 15) == 15 and tuner.team(1, 9, 15) == 15  # (the first call starts the token count)


def test_steps_of_another_team_and_steps_without_worker_time_are_not_samples():
    tuner = TeamTuner()
    tuner.team(1, None, 15)
    for _ in range(10 * SAMPLES):
        tuner.observe(1, 11, 0.5)  # a step begun before the team changed
        tuner.observe(1, 15, team_tuner.MIN_SECONDS / 2)
        tuner.observe(2, 15, 0.5)  # a token count never asked for
    state = tuner._by_tokens[1]
    assert state.recent == [] and state.trial is None and tuner.team(1, None, 15) == 15 and 2 not in tuner._by_tokens


def test_teams_stay_between_half_the_largest_and_the_largest():
    tuner = TeamTuner()
    teams = run(tuner, lambda team, step: 0.01 * team, 6000)  # smaller always faster
    assert min(teams) == 7 and max(teams) == 15 and teams[-1] == 7
    assert TeamTuner().team(1, 12, 15) == 12 and TeamTuner().team(1, 3, 15) == 3
    assert TeamTuner().team(1, 20, 15) == 15
    assert set(run(TeamTuner(), quiet, 500, largest=1)) == {1}
    with pytest.raises(ValueError, match="1 thread or more"):
        TeamTuner().team(1, None, 0)
