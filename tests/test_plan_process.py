"""Plans made in the planning process (vramshard.runtime.plan_process) are the plans made here."""

import os
import time
from pathlib import Path

import pytest
import torch

from vramshard.errors import BudgetError
from vramshard.models import build_model
from vramshard.models.base import Model
from vramshard.plan.mechanisms import Mechanisms, fixed_mechanisms
from vramshard.plan.tiers import Tiers
from vramshard.profile.query import synthetic
from vramshard.runtime import budget as budgets
from vramshard.runtime import plan_process, plan_wire
from vramshard.shapes import SHAPES, shape_config

GiB = 2**30


@pytest.fixture(scope="module")
def planned():
    """A real shape's plan inputs (no weights: the planner reads shapes) and one child for the module."""
    model = build_model(shape_config("llama3-8b"), torch.bfloat16)
    profile = synthetic(cpu_gflops=400, gpu_gflops=200_000, h2d_gbps=50, cpu_threads=16)
    settings = budgets.PlanSettings(profile, Tiers((1, 64, 1024)), 2048, 2, "llama3-8b")
    child = plan_process.PlanProcess()
    yield model, settings, child
    child.close()


def test_a_plan_made_in_the_process_is_the_plan_made_here(planned):
    model, settings, child = planned
    there = child.make_plan(model, settings, 2 * GiB)
    here = budgets.make_plan(model, settings, 2 * GiB)
    assert there == here  # every field, each tier's placements of every family too
    assert child.running and child.started == 1


def test_the_fitted_factors_travel_with_the_profile(planned):
    """A calibrated profile (factors fitted in the engine's steps) plans in the child as here."""
    model, settings, child = planned
    fitted = budgets.PlanSettings(settings.profile.calibrated(cpu_scale=1.3, cpu_rows={1: 0.5, 64: 2.0},
                                                              split_rows={64: 1.5}, dispatch_scale=2.0),
                                  settings.tiers, settings.context, settings.num_slots, settings.name)
    there = child.make_plan(model, fitted, 4 * GiB)
    assert there == budgets.make_plan(model, fitted, 4 * GiB)
    assert there != budgets.make_plan(model, settings, 4 * GiB)  # (the factors change the plan: the check can fail)


def test_an_moe_plan_crosses_the_wire_whole():
    """Every field of a plan with an expert cache and zero-copy shares, through JSON and back."""
    model = build_model(shape_config("qwen3-30b-a3b"), torch.bfloat16)
    profile = synthetic(cpu_gflops=400, gpu_gflops=200_000, h2d_gbps=50, cpu_threads=16)
    settings = budgets.PlanSettings(profile, Tiers((1, 16, 512)), 2048, 2, "qwen3-30b-a3b")
    plan = budgets.make_plan(model, settings, 8 * GiB)
    assert plan.expert_cache > 0 and plan.reasons
    line = plan_wire.dumps({"plan": plan_wire.plan_to_wire(plan)})
    assert b"\n" not in line[:-1]
    assert plan_wire.plan_from_wire(plan_wire.loads(line)["plan"]) == plan
    request = plan_wire.request(plan_wire.model_recipe(model), settings, 8 * GiB, None, True, Mechanisms.here())
    rebuilt, *_ = plan_wire.read_request(plan_wire.loads(plan_wire.dumps(request)))
    assert plan_wire.fingerprint(rebuilt) == plan_wire.fingerprint(model)


def test_a_model_the_child_would_build_otherwise_is_refused():
    model = build_model(shape_config("llama3-8b"), torch.bfloat16)
    recipe = plan_wire.model_recipe(model)
    for changed in ({**recipe, "dtype": "float16"}, {**recipe, "config": {**recipe["config"], "rms_norm_eps": 1e-3}}):
        with pytest.raises(plan_wire.WireError, match="differs"):
            plan_wire.build_from_recipe(changed)
    with pytest.raises(plan_wire.WireError, match="no sub-layer"):
        plan_wire.build_from_recipe({**recipe, "sublayers": recipe["sublayers"] + ["ffn[99]"]})


def test_a_model_not_built_from_a_config_is_planned_here(planned, monkeypatch):
    model, settings, _ = planned
    bare = Model(model.args, list(model), model.dtype)  # (no config.json dict to build it from)

    class Unused(plan_process.PlanProcess):
        def _start(self):
            raise AssertionError("a planning process was started for it")

    monkeypatch.setattr(plan_process, "_shared", Unused())
    monkeypatch.setattr(plan_process, "_failed", None)
    monkeypatch.setattr(plan_process, "ENABLED", True)
    assert plan_process.make_plan_off_thread(bare, settings, 8 * GiB, search=False) == \
        budgets.make_plan(model, settings, 8 * GiB, search=False)
    assert plan_process._failed is None  # (the process still plans for other models)


def test_the_process_prices_the_callers_mechanisms(planned):
    """The child plans with how this process's executor runs its CPU work, not its own switches."""
    model, settings, child = planned
    ahead = Mechanisms(run_ahead=True, cpu_packed=False, cpu_gemv=False, zero_copy=(False, 0), run_ahead_dense=True)
    plain = Mechanisms(run_ahead=False, cpu_packed=False, cpu_gemv=False, zero_copy=(False, 0))
    with fixed_mechanisms(ahead):
        assert Mechanisms.here() == ahead
        there = child.make_plan(model, settings, 4 * GiB)
        here = budgets.make_plan(model, settings, 4 * GiB)
    with fixed_mechanisms(plain):
        other = budgets.make_plan(model, settings, 4 * GiB)
    assert there == here
    assert here != other  # (the mechanisms change the estimates: the check can fail)


def test_every_mechanism_crosses_the_wire():
    """Each mechanism, set against its default, comes back as sent; one the child does not know is refused."""
    import dataclasses

    base = Mechanisms(run_ahead=False, cpu_packed=False, cpu_gemv=False, zero_copy=(False, 0))
    for field in dataclasses.fields(Mechanisms):
        value = (True, 7) if field.name == "zero_copy" else not getattr(base, field.name)
        sent = dataclasses.replace(base, **{field.name: value})
        assert Mechanisms.from_wire(plan_wire.loads(plan_wire.dumps(sent.to_wire()))) == sent, field.name
    with pytest.raises(ValueError, match="unknown here: \\['tensor_cores'\\]"):
        Mechanisms.from_wire({**base.to_wire(), "tensor_cores": True})
    assert Mechanisms.from_wire({k: v for k, v in base.to_wire().items() if k != "amx"}).amx is False  # (default)


def test_a_planner_error_is_raised_here_as_it_was_there(planned):
    model, settings, child = planned
    with pytest.raises(BudgetError) as there:
        child.make_plan(model, settings, 2**20, kv_on_gpu=True)
    with pytest.raises(BudgetError) as here:
        budgets.make_plan(model, settings, 2**20, kv_on_gpu=True)
    assert str(there.value) == str(here.value) and "minimum" in str(there.value)
    assert child.running  # the child goes on serving


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="the idle scheduling class is Linux's")
def test_the_child_takes_only_idle_cores(planned):
    """The child plans at the idle scheduling class, so that it never takes a core from the steps'
    OpenMP teams."""
    model, settings, child = planned
    child.make_plan(model, settings, 8 * GiB, search=False)
    assert os.sched_getscheduler(child._child.pid) == os.SCHED_IDLE


def test_an_idle_child_stops_and_the_next_plan_starts_another(planned):
    model, settings, _ = planned
    child = plan_process.PlanProcess(idle_exit_s=0.2)
    try:
        child.make_plan(model, settings, 8 * GiB, search=False)
        deadline = time.monotonic() + 20
        while child.running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not child.running
        child.make_plan(model, settings, 8 * GiB, search=False)
        assert child.started == 2 and child.plans == 2
    finally:
        child.close()


def test_a_dead_child_is_replaced_once_then_plans_are_made_here(planned, monkeypatch, caplog):
    model, settings, _ = planned
    child = plan_process.PlanProcess()
    try:
        child.make_plan(model, settings, 8 * GiB, search=False)
        child._child.kill()
        child._child.wait()
        assert child.make_plan(model, settings, 8 * GiB, search=False) is not None  # a new child
        assert child.started == 2
    finally:
        child.close()

    class Broken(plan_process.PlanProcess):
        def _start(self):
            raise OSError("no interpreter here")

    monkeypatch.setattr(plan_process, "_shared", Broken())
    monkeypatch.setattr(plan_process, "_failed", None)
    monkeypatch.setattr(plan_process, "ENABLED", True)
    with caplog.at_level("WARNING"):
        plan = plan_process.make_plan_off_thread(model, settings, 8 * GiB, search=False)
    assert plan.to_dict() == budgets.make_plan(model, settings, 8 * GiB, search=False).to_dict()
    assert "no interpreter here" in caplog.text and plan_process._failed is not None


def test_a_child_that_does_not_answer_is_killed_and_the_caller_told(planned):
    model, settings, _ = planned

    class Mute(plan_process.PlanProcess):
        def _start(self):
            import subprocess
            import sys

            self._child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            self.started += 1
            return self._child

    child = Mute(answer_s=0.5)
    began = time.monotonic()
    try:
        with pytest.raises(plan_process.PlanProcessError, match="the planning process failed"):
            child.make_plan(model, settings, 8 * GiB, search=False)
        assert time.monotonic() - began < 30 and not child.running and child.started == 1
    finally:
        child.close()


@pytest.mark.parametrize("budget", [2 * GiB, 2**20], ids=["plan", "planner-error"])
def test_a_child_whose_engine_went_away_mid_plan_ends_quietly(planned, budget):
    """The engine's process ended (its end of the replies closed) while the child made a plan: the
    child ends without a traceback (one was printed into the thirty-sixth GPU session's logs), its
    reply long (a plan) or short (a planner's error)."""
    import subprocess
    import sys

    from vramshard.plan.mechanisms import Mechanisms

    model, settings, _ = planned
    source = str(Path(plan_process.__file__).resolve().parents[2])
    child = subprocess.Popen([sys.executable, "-c", plan_process._CHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=dict(os.environ, PYTHONPATH=source, OMP_NUM_THREADS="1"))
    request = plan_wire.request(plan_wire.model_recipe(model), settings, budget, None, True, Mechanisms.here())
    child.stdout.close()  # (the engine gone: nobody reads the reply)
    child.stdin.write(plan_wire.dumps(request))
    child.stdin.close()
    errors = child.stderr.read().decode()
    assert child.wait(timeout=120) == 0 and "Traceback" not in errors and "Broken" not in errors, errors


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_every_shape_is_built_again_from_its_recipe(name):
    """Every architecture the shapes cover, and a vision-language model's language part (the
    sub-layers its plans place), built again in the child as here."""
    model = build_model(shape_config(name))
    models = [model]
    if any(s.kind == "vision" for s in model):
        models.append(Model(model.args, [s for s in model if s.kind != "vision"], model.dtype, model.config))
    for original in models:
        message = plan_wire.loads(plan_wire.dumps(plan_wire.model_recipe(original)))
        rebuilt = plan_wire.build_from_recipe(message)
        assert [s.name for s in rebuilt] == [s.name for s in original]
        assert plan_wire.fingerprint(rebuilt) == plan_wire.fingerprint(original)


def test_the_childs_pid_is_known_while_it_runs(planned, monkeypatch):
    """(Its CPU time is the engine's own work, not the load beside it: runtime/host_load.py.)"""
    model, settings, child = planned
    monkeypatch.setattr(plan_process, "_shared", child)
    child.make_plan(model, settings, 2 * GiB)
    assert plan_process.child_pids() == [child._child.pid]
    child.close()
    assert plan_process.child_pids() == []
    monkeypatch.setattr(plan_process, "_shared", None)
    assert plan_process.child_pids() == []


def test_the_process_says_when_it_is_making_a_plan(planned, monkeypatch):
    """:func:`plan_process.planning` is true while a request is in flight (the steps spare a core then),
    false before and after, and after a failed request too."""
    import threading

    model, settings, child = planned
    monkeypatch.setattr(plan_process, "_shared", child)
    entered, release = threading.Event(), threading.Event()
    ask = child._ask

    def held_ask(request, retry):
        entered.set()
        release.wait(30)
        return ask(request, retry)

    monkeypatch.setattr(child, "_ask", held_ask)
    assert not plan_process.planning()
    thread = threading.Thread(target=child.make_plan, args=(model, settings, 8 * GiB), kwargs={"search": False})
    thread.start()
    assert entered.wait(30)
    assert plan_process.planning() and child.asking == 1
    release.set()
    thread.join(60)
    assert not plan_process.planning() and child.asking == 0
    monkeypatch.setattr(child, "_ask", lambda request, retry: (_ for _ in ()).throw(plan_process.PlanProcessError("x")))
    with pytest.raises(plan_process.PlanProcessError):
        child.make_plan(model, settings, 8 * GiB, search=False)
    assert not plan_process.planning()
