"""The estimator prices the host's issue of each stream-slot fill: the thread that issues the ring's fills also
queues the GPU's work and computes the CPU's, so a step whose host is busy is longer by its fills' issue."""

import dataclasses
import math

import pytest
import torch

from vramshard.errors import ProfileError
from vramshard.plan.estimator import FILL_CALLS, SPLIT_FILL_RANGES, Estimator
from vramshard.plan.mechanisms import Mechanisms, fill_graphs_enabled, fixed_mechanisms
from vramshard.plan.placement import CPU, GPU_RESIDENT, GPU_STREAMED, Placement, split_ffn
from vramshard.plan.memory import split_part_bytes, sublayer_packed_bytes
from vramshard.profile.query import (FILL_ISSUE_H100, FILL_ISSUE_H100_DISPATCH_S, FILL_ROUND_CALLS, Profile,
                                     synthetic)
from vramshard.runtime.plan_wire import model_recipe, read_request, request
from vramshard.runtime import budget as budgets
from vramshard.plan.tiers import Tiers
from vramshard.runtime.wire_codec import ROUND_RAW_BYTES
from vramshard.shapes import shape_model

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LLAMA = shape_model("llama3-8b", torch.bfloat16)
PROFILE = synthetic(cpu_gflops=1500, gpu_gflops=400_000, h2d_gbps=50, cpu_mem_gbps=80, gpu_mem_gbps=3000)
ISSUE = {"graph": 30e-6, "graph_round": 5e-6, "round": 90e-6}


def with_fill_issue(figures: dict) -> Profile:
    return Profile.from_dict({**PROFILE.to_dict(), "fill_issue": figures})


def coded(graphs: bool = True, wire: bool = True):
    return fixed_mechanisms(dataclasses.replace(Mechanisms.here(), wire_codec=wire, fill_graphs=graphs,
                                                decode_graphs=False))


def placement_of(ffn) -> Placement:
    """Every FFN at ``ffn``, attention resident, the embedding on the CPU."""
    return Placement("test", tuple((s.name, ffn if s.kind == "ffn" else CPU if s.kind == "embed" else GPU_RESIDENT)
                                   for s in LLAMA))


def test_a_fill_costs_the_host_its_rounds_as_the_profile_timed_them():
    ffn = LLAMA["ffn[0]"]
    profile = with_fill_issue(ISSUE)
    rounds = math.ceil(sublayer_packed_bytes(LLAMA, "ffn[0]") / ROUND_RAW_BYTES)
    assert rounds == 22  # (a llama3-8b FFN: its matrices 21 rounds of 16 MiB, and its norm)
    with coded(graphs=True):
        assert Estimator(LLAMA, profile).fill_issue_s(ffn, GPU_STREAMED) == pytest.approx(30e-6 + 22 * 5e-6)
        # A split's GPU part: its gate, up and down rows each a coded fill, its norm one raw copy.
        part = split_ffn(6)
        third = math.ceil(split_part_bytes(LLAMA, "ffn[0]", 6) / SPLIT_FILL_RANGES / ROUND_RAW_BYTES)
        call = 90e-6 / FILL_ROUND_CALLS  # (one call of a round issued by itself)
        assert Estimator(LLAMA, profile).fill_issue_s(ffn, part) \
            == pytest.approx(SPLIT_FILL_RANGES * (30e-6 + third * 5e-6) + call)
    with coded(graphs=False):  # round by round
        assert Estimator(LLAMA, profile).fill_issue_s(ffn, GPU_STREAMED) == pytest.approx(22 * 90e-6)
    with coded(wire=False):  # raw: one copy and the ring's calls around it
        assert Estimator(LLAMA, profile).fill_issue_s(ffn, GPU_STREAMED) == pytest.approx((FILL_CALLS + 1) * call)


def test_a_profile_without_the_figures_takes_the_h100s_at_its_own_dispatch_cost():
    assert "fill_issue" not in PROFILE.to_dict()
    at_its_cost = PROFILE.dispatch_s("cuda") / FILL_ISSUE_H100_DISPATCH_S
    assert PROFILE.fill_issue_s(21) == pytest.approx((FILL_ISSUE_H100["graph"] + 21 * FILL_ISSUE_H100["graph_round"])
                                                     * at_its_cost)
    assert PROFILE.fill_issue_s(5, graphs=False) == pytest.approx(5 * FILL_ISSUE_H100["round"] * at_its_cost)
    measured = with_fill_issue(ISSUE)
    assert measured.fill_issue_s(2) == pytest.approx(40e-6)
    assert measured.calibrated(dispatch_scale=3.0).fill_issue_s(2) == pytest.approx(120e-6)  # (the engine's fit)
    assert measured.summary()["fill_issue_us"] == pytest.approx({"graph": 30, "graph_round": 5, "round": 90})
    with pytest.raises(ProfileError, match="coded fill's host issue: round"):
        with_fill_issue({**ISSUE, "round": 0})


def test_a_step_whose_host_is_busy_is_longer_by_its_fills_issue():
    """FFNs streamed, their fills slow to issue: the host thread issues each after queuing the FFN that frees its
    slot, so the step takes at least every fill's issue, and a fill's copy begins only once it is issued."""
    slow = with_fill_issue({"graph": 20e-3, "graph_round": 1e-6, "round": 1e-3})
    fast = with_fill_issue({"graph": 1e-9, "graph_round": 1e-9, "round": 1e-9})
    placement = placement_of(GPU_STREAMED)
    fills = len(placement.names(home="stream"))
    with coded(graphs=True):
        slow_step = Estimator(LLAMA, slow).simulate(placement, 1, 1024)
        fast_step = Estimator(LLAMA, fast).simulate(placement, 1, 1024)
    assert fills == LLAMA.args.num_hidden_layers
    assert slow_step.copy_busy == pytest.approx(fast_step.copy_busy)  # the same copies
    assert slow_step.seconds >= fills * 20e-3
    copies = [start for _, engine, start, _ in slow_step.timeline if engine == "copy"]
    assert len(copies) >= fills and min(copies) >= 20e-3  # (the first is issued at the step's start)
    assert fast_step.seconds < fills * 20e-3 / 2  # (the copies alone: 32 of ~5.3 ms)
    # Round by round the issue grows with the rounds (22 a fill here, 1 ms each).
    with coded(graphs=False):
        eager = Estimator(LLAMA, slow).simulate(placement, 1, 1024)
    assert eager.seconds >= fills * 22e-3


def test_the_engines_choice_of_fill_graphs_crosses_to_a_planning_process():
    for graphs in (False, True):
        with coded(graphs=graphs):
            assert fill_graphs_enabled() is graphs and Estimator(LLAMA, PROFILE).fill_graphs is graphs
            settings = budgets.PlanSettings(PROFILE, Tiers((1,)), 1024, 2, "llama3-8b")
            asked = request(model_recipe(LLAMA), settings, 8 * 2**30, None, True, settings.mechanisms())
            *_, mechanisms = read_request(asked)
        assert mechanisms.fill_graphs is graphs


@pytest.mark.gpu
@gpu
def test_the_profiler_times_the_hosts_issue_of_a_coded_fill():
    from vramshard.profile.bench_fill_issue import measure_fill_issue
    from vramshard.profile.progress import ProgressSink

    figures = measure_fill_issue(budget_s=0.3, progress=ProgressSink(), weight=1.0)
    assert figures is not None and set(figures) == {"graph", "graph_round", "round"}
    assert all(0 < seconds < 0.05 for seconds in figures.values())
    # A round issued by itself (a copy, a decode, their events) costs the host more than a round inside a replay.
    assert figures["round"] > figures["graph_round"]
