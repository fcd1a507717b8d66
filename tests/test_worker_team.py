"""The run-ahead worker's OpenMP team: the profile times the one-token expert pass beside Python by
team size, the planner gives decode tiers the fastest team, and the worker computes with it."""

from __future__ import annotations

import copy

import pytest

from vramshard.errors import InvalidInputError, ProfileError
from vramshard.plan.memory import moe_layers, sublayer_triples
from vramshard.plan.placement import TieredPlacement, named_placement
from vramshard.plan.planner import WORKER_TEAM_ROWS, Planner
from vramshard.plan.tiers import Tiers
from vramshard.profile.bench_experts import team_candidates
from vramshard.profile.query import TEAM_MARGIN, Profile, fastest_team, synthetic
from vramshard.runtime import run_ahead, zero_copy_experts
from vramshard.shapes import shape_model

QWEN30 = shape_model("qwen3-30b-a3b")
GiB = 2**30


def test_team_candidates_run_from_one_core_fewer_to_a_quarter_of_the_cores():
    assert team_candidates(15) == [15, 12, 8, 4]
    assert team_candidates(3) == [3, 2, 1]
    assert team_candidates(1) == [1]


def test_the_fastest_team_must_beat_the_largest_by_the_margin():
    assert fastest_team({"15": 30e9, "12": 45e9, "8": 60e9, "4": 40e9}) == 8
    assert fastest_team({"15": 30e9, "8": 30e9 * (1 + TEAM_MARGIN / 2)}) == 15  # (within the noise)
    assert fastest_team({"15": 30e9, "8": 20e9}) == 15
    assert fastest_team({"1": 5e9}) == 1


def test_the_worker_takes_the_plans_team_where_it_is_smaller(monkeypatch):
    monkeypatch.setattr(run_ahead.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr(run_ahead, "FORCED_TEAM", None)
    assert run_ahead.worker_threads(16, 8) == 8
    assert run_ahead.worker_threads(16, None) == 15
    assert run_ahead.worker_threads(4, 8) == 4  # (never more than the part asked for)
    monkeypatch.setattr(run_ahead, "FORCED_TEAM", 6)  # VRAMSHARD_WORKER_THREADS
    assert run_ahead.worker_threads(16, 8) == 6 and run_ahead.worker_threads(16) == 6


def test_a_bad_forced_team_is_ignored_with_a_warning(monkeypatch, caplog):
    monkeypatch.setenv("VRAMSHARD_WORKER_THREADS", "many")
    assert run_ahead._forced_team() is None
    assert "VRAMSHARD_WORKER_THREADS='many' is not a thread count" in caplog.text
    monkeypatch.setattr(run_ahead.os, "cpu_count", lambda: 16)
    monkeypatch.setenv("VRAMSHARD_WORKER_THREADS", "3")
    assert run_ahead._forced_team() == 3
    monkeypatch.setenv("VRAMSHARD_WORKER_THREADS", "64")
    assert run_ahead._forced_team() == 16  # (not more than the cores)


def with_teams(profile: Profile, teams: dict[str, float] | None, beside: str | None = "launches") -> Profile:
    """``profile`` with the worker's one-token pass timed by team, ``beside`` a host thread of that kind
    (None: before session 39, beside Python alone)."""
    data = copy.deepcopy(profile.data)
    if teams is not None:
        data["host_experts_worker_teams"] = {"bf16": teams}
        if beside is not None:
            data["host_experts_worker_beside"] = beside
    return Profile(data)


def test_the_profile_names_the_fastest_team_and_refuses_bad_team_sizes():
    base = synthetic(cpu_gflops=1500, gpu_gflops=200_000, h2d_gbps=50, cpu_mem_gbps=80, gpu_mem_gbps=1500)
    assert base.worker_team("bf16") is None
    profile = with_teams(base, {"15": 30e9, "8": 45e9})
    assert profile.worker_team("bf16") == 8
    assert profile.worker_team("fp16") == 8  # (the dtype that was timed)
    assert with_teams(base, {"15": 30e9, "8": 45e9}, beside=None).worker_team("bf16") is None  # (beside Python alone)
    assert profile.summary()["host_experts_worker_teams_gb_s"] == {"bf16": {"15": 30.0, "8": 45.0}}
    with pytest.raises(ProfileError, match="host_experts_worker_teams' threads for bf16 must be positive integers"):
        with_teams(base, {"0": 30e9})
    with pytest.raises(ProfileError, match="at 8 threads must be a positive number"):
        with_teams(base, {"8": -1.0})


def plan_qwen30(monkeypatch, teams: dict[str, float] | None, ahead: bool = True):
    monkeypatch.setattr(zero_copy_experts, "available", lambda: True)
    monkeypatch.setattr(run_ahead, "available", lambda dense=False: ahead)
    profile = with_teams(synthetic(cpu_gflops=1500, gpu_gflops=200_000, h2d_gbps=50, cpu_mem_gbps=80,
                                   gpu_mem_gbps=1500), teams)
    return Planner(QWEN30, profile, 8 * GiB, context=2048, tiers=Tiers((1, 16, 512))).plan()


def test_the_planner_gives_decode_tiers_the_profiles_fastest_team(monkeypatch):
    result = plan_qwen30(monkeypatch, {"15": 30e9, "12": 40e9, "8": 47e9, "4": 35e9})
    assert result.worker_team == 8
    tiered = result.tiered()
    assert tiered.worker_threads == (8, 8, None) and WORKER_TEAM_ROWS == 16
    assert [tiered.worker_threads_for(n) for n in (1, 16, 17, 4096)] == [8, 8, None, None]
    assert any("run-ahead worker: 8 CPU threads" in note for note in result.notes)
    assert result.to_dict()["worker_team"] == 8


def test_no_team_without_the_timings_or_without_the_worker(monkeypatch):
    for teams, ahead in ((None, True), ({"15": 30e9, "8": 47e9}, False)):
        result = plan_qwen30(monkeypatch, teams, ahead)
        assert result.worker_team is None and result.tiered().worker_threads == ()
        assert not any("run-ahead worker:" in note for note in result.notes)


def test_a_tiered_placements_worker_threads_round_trip_and_bad_ones_are_refused():
    p = named_placement("experts-cpu", sublayer_triples(QWEN30), QWEN30.args.num_hidden_layers,
                        moe_layers=moe_layers(QWEN30))
    tiered = TieredPlacement((1, 512), (p, p), (None, None), worker_threads=(8, None))
    again = TieredPlacement.from_json(tiered.to_json())
    assert again.worker_threads == (8, None) and again.worker_threads_for(1) == 8
    assert again.worker_threads_for(600) is None
    plain = TieredPlacement.from_json(TieredPlacement((1,), (p,), (None,)).to_json())
    assert plain.worker_threads == () and plain.worker_threads_for(1) is None
    for bad in ((8,), (0, None), (2.5, None)):
        with pytest.raises(InvalidInputError, match="one count ≥ 1 \\(or null\\) per tier"):
            TieredPlacement((1, 512), (p, p), (None, None), worker_threads=bad)
