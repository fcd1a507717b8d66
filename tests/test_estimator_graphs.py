"""The estimator prices decode steps as the executor runs them: each run of GPU-resident sub-layers replayed
from a CUDA graph (one replay's host cost), every other sub-layer launched eagerly."""

import json

import pytest
import torch

from vramshard.plan.estimator import BATCH_BUCKETS, DISPATCH_LAUNCHES, GRAPH_REPLAY_SHARE, REPLAY_CALLS, Estimator
from vramshard.plan.mechanisms import decode_graphs_enabled, pricing_graphs
from vramshard.plan.placement import CPU, GPU_RESIDENT, GPU_STREAMED, Placement
from vramshard.plan.planner import Planner
from vramshard.plan.tiers import Tiers
from vramshard.profile.query import Profile, synthetic
from vramshard.runtime import budget as budgets
from vramshard.runtime.plan_wire import model_recipe, read_request, request
from vramshard.shapes import shape_model

LLAMA = shape_model("llama3-8b", torch.bfloat16)
# A host whose eager launches are slow beside its GPU (40 us a sub-layer of DISPATCH_LAUNCHES launches).
PROFILE = synthetic(cpu_gflops=1500, gpu_gflops=400_000, h2d_gbps=50, cpu_mem_gbps=80, gpu_mem_gbps=3000)


def placement_of(where_by_name: dict, default=GPU_RESIDENT) -> Placement:
    return Placement("test", tuple((s.name, where_by_name.get(s.name, default)) for s in LLAMA))


def test_a_resident_decode_step_pays_one_replay_not_its_launches():
    everything = placement_of({})
    eager = Estimator(LLAMA, PROFILE, graphs=False).simulate(everything, 1, 1024)
    graphs = Estimator(LLAMA, PROFILE, graphs=True).simulate(everything, 1, 1024)
    launches = sum(s.launches for s in LLAMA)
    launch = PROFILE.dispatch_s("cuda") / DISPATCH_LAUNCHES
    # Eager: the host's launches bound the step (and the logits' way back); replayed: the kernels, after one
    # replay's host work.
    assert launches * launch > eager.gpu_busy
    assert launches * launch <= eager.seconds <= 1.1 * launches * launch
    replay = (REPLAY_CALLS + GRAPH_REPLAY_SHARE) * launch
    assert graphs.seconds == pytest.approx(graphs.gpu_busy + replay, rel=0.05)
    assert graphs.gpu_busy == pytest.approx(eager.gpu_busy)  # the same kernels
    assert graphs.seconds < 0.8 * eager.seconds


def test_prompt_chunks_and_steps_beyond_the_largest_batch_bucket_launch_eagerly():
    estimator = Estimator(LLAMA, PROFILE, graphs=True)
    everything = placement_of({})
    assert estimator.replayed_launches(everything, BATCH_BUCKETS[-1])
    assert estimator.replayed_launches(everything, BATCH_BUCKETS[-1] + 1) == {}
    chunk = 512
    assert estimator.simulate(everything, chunk, 1024).seconds == pytest.approx(
        Estimator(LLAMA, PROFILE, graphs=False).simulate(everything, chunk, 1024).seconds)
    assert Estimator(LLAMA, PROFILE, graphs=False).replayed_launches(everything, 1) == {}


def test_a_streamed_or_cpu_sub_layer_ends_a_run_and_launches_eagerly():
    placement = placement_of({"ffn[3]": GPU_STREAMED, "ffn[7]": CPU})
    estimator = Estimator(LLAMA, PROFILE, graphs=True)
    replayed = estimator.replayed_launches(placement, 1)
    assert "ffn[3]" not in replayed and "ffn[7]" not in replayed
    # Three runs, each charged its replay once, on its first sub-layer.
    firsts = {name for name, seconds in replayed.items() if seconds > 0}
    assert firsts == {next(iter(LLAMA)).name, "attn[4]", "attn[8]"}
    names = [s.name for s in LLAMA]
    run = list(LLAMA)[names.index("attn[4]"):names.index("ffn[7]")]
    assert replayed["attn[4]"] == pytest.approx(estimator.replay_s(sum(s.launches for s in run)))
    assert all(replayed[s.name] == 0.0 for s in run[1:])


def test_a_measured_replay_prices_the_graphs_and_scales_with_the_hosts_dispatch():
    timed = Profile({**PROFILE.data, "dispatch": {**PROFILE.data["dispatch"], "cuda_graph": 8e-6,
                                                  "cuda_graph_node": 0.5e-6}})
    assert PROFILE.graph_replay_s(100) is None  # not measured: the estimator's share of a launch
    assert timed.graph_replay_s(10) == pytest.approx(8e-6)
    assert timed.graph_replay_s(100) == pytest.approx(8e-6 + 90 * 0.5e-6)
    assert timed.calibrated(dispatch_scale=2.0).graph_replay_s(100) == pytest.approx(2 * (8e-6 + 90 * 0.5e-6))
    launch = timed.dispatch_s("cuda") / DISPATCH_LAUNCHES
    assert Estimator(LLAMA, timed, graphs=True).replay_s(100) == pytest.approx(REPLAY_CALLS * launch + 53e-6)


def test_planning_prices_the_graphs_an_engine_runs():
    # An engine with graphs off prices eager launches wherever its process is; one with graphs, replays.
    for graphs in (False, True):
        settings = budgets.PlanSettings(PROFILE, Tiers((1,)), 1024, 2, "llama3-8b", decode_graphs=graphs)
        assert settings.mechanisms().decode_graphs is graphs
        with settings.pricing():
            assert decode_graphs_enabled() is graphs
            assert Estimator(LLAMA, PROFILE).graphs is graphs
        # A planning process is told the engine's choice.
        asked = request(model_recipe(LLAMA), settings, 8 * 2**30, None, True, settings.mechanisms())
        *_, mechanisms = read_request(asked)
        assert mechanisms.decode_graphs is graphs
    assert decode_graphs_enabled() is torch.cuda.is_available()  # outside: as an engine here would run


def test_with_graphs_priced_the_planner_predicts_a_resident_plan_faster():
    def predicted(graphs: bool) -> float:
        with pricing_graphs(graphs):
            plan = Planner(LLAMA, PROFILE, 12 * 2**30, context=1024, tiers=Tiers((1, 512))).plan()
        return plan.tiers[1].predicted_s, plan.tiers[512].predicted_s

    eager, replayed = predicted(False), predicted(True)
    assert replayed[0] < eager[0]  # decode: its resident runs replayed
    assert replayed[1] == pytest.approx(eager[1], rel=0.02)  # a prompt chunk is not a decode step


def test_vramshard_plan_prices_the_graphs_unless_told_not_to(tmp_path, capsys):
    from vramshard.cli.main import main
    from vramshard.profile.store import save

    path = save(PROFILE, tmp_path / "profile.json")
    planned = {}
    for flag in ("--cuda-graphs", "--no-cuda-graphs"):
        assert main(["plan", "--shape", "llama3-8b", "--vram", "12GiB", "--ctx", "1024", "--tiers", "1,512",
                     "--profile", str(path), "--json", flag]) == 0
        planned[flag] = json.loads(capsys.readouterr().out)
    said = {flag: [n for n in plan["notes"] if "CUDA graphs" in n or "every launch eager" in n]
            for flag, plan in planned.items()}
    assert "replayed from CUDA graphs" in said["--cuda-graphs"][0]
    assert "every launch eager" in said["--no-cuda-graphs"][0] and len(said["--no-cuda-graphs"]) == 1
    graphs, eager = planned["--cuda-graphs"]["tiers"], planned["--no-cuda-graphs"]["tiers"]
    assert graphs["1"]["predicted_ms"] < eager["1"]["predicted_ms"]
    assert graphs["512"]["predicted_ms"] == pytest.approx(eager["512"]["predicted_ms"], rel=0.02)
