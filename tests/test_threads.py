"""The engine's CPU thread limit (``Engine.load(threads=N)``, ``--threads``): planned, priced and kept."""

import json

import pytest
import torch

from vramshard import Engine
from vramshard.errors import InvalidInputError
from vramshard.plan.placement import TieredPlacement
from vramshard.plan.planner import Planner
from vramshard.plan.tiers import Tiers
from vramshard.profile.query import synthetic
from vramshard.runtime import plan_wire
from vramshard.runtime.executor import use_cpu_threads
from vramshard.shapes import shape_model

GiB = 2**30


@pytest.fixture
def machine():
    """A 16-core machine whose CPU is fast enough that plans put work on it."""
    return synthetic(cpu_gflops=2000, gpu_gflops=200_000, h2d_gbps=20, cpu_threads=16)


def test_a_limited_profile_prices_cpu_work_at_the_limit(machine):
    limited = machine.limited_to(4)
    assert limited.thread_limit == 4 and machine.thread_limit is None  # (the profile itself unchanged)
    for m in (1, 64):
        at_four = machine.matmul_s(m, 4096, 14336, "bf16", "cpu", threads=4)
        assert at_four > 1.5 * machine.matmul_s(m, 4096, 14336, "bf16", "cpu")
        assert limited.matmul_s(m, 4096, 14336, "bf16", "cpu") == pytest.approx(at_four)  # all cores asked
        assert limited.matmul_s(m, 4096, 14336, "bf16", "cpu", threads=16) == pytest.approx(at_four)
        assert limited.matmul_s(m, 4096, 14336, "bf16", "cpu", threads=2) == \
            pytest.approx(machine.matmul_s(m, 4096, 14336, "bf16", "cpu", threads=2))  # fewer: as they are
    assert limited.matmul_s(1, 4096, 4096, "bf16", "cuda") == machine.matmul_s(1, 4096, 4096, "bf16", "cuda")
    assert machine.limited_to(16).thread_limit is None and machine.limited_to(None).thread_limit is None
    assert limited.calibrated(cpu_scale=1.2).thread_limit == 4  # (the engine's fits keep it)
    for bad in (0, -2, 2.5):
        with pytest.raises(InvalidInputError, match="CPU thread limit must be a whole number"):
            machine.limited_to(bad)


def test_the_limit_crosses_to_the_planning_process(machine):
    there = plan_wire.profile_from_wire(json.loads(json.dumps(plan_wire.profile_to_wire(machine.limited_to(6)))))
    assert there.thread_limit == 6
    assert plan_wire.profile_from_wire(plan_wire.profile_to_wire(machine)).thread_limit is None


def test_a_plan_under_a_thread_limit_uses_no_more_threads_and_leans_less_on_the_cpu(machine):
    model = shape_model("llama3-8b")
    tiers = Tiers((1, 16, 64, 512))
    free = Planner(model, machine, 4 * GiB, context=2048, tiers=tiers).plan()
    limited = Planner(model, machine.limited_to(2), 4 * GiB, context=2048, tiers=tiers).plan()
    for tier in tiers.sizes:
        assert limited.tiers[tier].threads is None or limited.tiers[tier].threads <= 2
        # CPU work priced at 2 threads: the chosen plan of each tier is predicted no faster
        assert limited.tiers[tier].predicted_s >= free.tiers[tier].predicted_s * 0.999
    assert any(limited.tiers[t].predicted_s > 1.05 * free.tiers[t].predicted_s for t in tiers.sizes)


def test_an_engine_computes_on_no_more_threads_than_asked(tiny_model_dir, monkeypatch):
    """A planned engine's tiers ask for all cores (None) or the plan's count: neither goes past
    ``threads`` (before, a planned engine ran its tiers on the plan's counts whatever it was given)."""
    path = tiny_model_dir("qwen3")
    before = torch.get_num_threads()
    try:
        profile = synthetic(cpu_gflops=2000, gpu_gflops=20_000, h2d_gbps=0.5, cpu_threads=2)
        engine = Engine.load(path, vram=160 * 2**20, simulate_gpu=True, threads=1, tiers=Tiers((1, 16)),
                             max_step_tokens=16, max_context=64, profile=profile)
        assert engine.budget.plan_settings().profile.thread_limit == 1
        seen = []
        real = engine.executor._run_locked

        def run_locked(*args, **kwargs):  # (each step's forward)
            out = real(*args, **kwargs)
            seen.append(torch.get_num_threads())
            return out

        engine.executor._run_locked = run_locked
        engine.generate([[1, 2, 3, 4]], max_new_tokens=4)
        assert seen and set(seen) == {1}
        # a plan that asks for more threads (one made without the limit, or by hand)
        real_for_tokens = TieredPlacement.for_tokens
        monkeypatch.setattr(TieredPlacement, "for_tokens",
                            lambda plans, tokens: (real_for_tokens(plans, tokens)[0], 2))
        seen.clear()
        engine.generate([[1, 2, 3, 4]], max_new_tokens=4)
        assert seen and set(seen) == {1}
    finally:
        use_cpu_threads(None)
        torch.set_num_threads(before)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_a_thread_count_that_is_no_count_is_refused_by_name(tiny_model_dir, bad):
    with pytest.raises(InvalidInputError, match="threads must be a whole number of CPU threads"):
        Engine.load(tiny_model_dir("qwen3"), threads=bad)


def test_vramshard_plan_threads_plans_for_that_many(capsys, machine, tmp_path):
    from vramshard.cli.main import main
    from vramshard.profile import save

    path = save(machine, tmp_path / "profile.json")
    args = ["plan", "--shape", "llama3-8b", "--vram", "4GiB", "--ctx", "1024", "--tiers", "1,64",
            "--profile", str(path), "--json"]
    assert main(args) == 0
    free = json.loads(capsys.readouterr().out)
    assert main(args + ["--threads", "2"]) == 0
    limited = json.loads(capsys.readouterr().out)
    assert all(t["threads"] is None or t["threads"] <= 2 for t in limited["tiers"].values())
    assert limited["tiers"]["1"]["predicted_ms"] > free["tiers"]["1"]["predicted_ms"]
