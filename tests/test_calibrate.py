"""Fitting the machine profile to measured decode steps (plan/calibrate.py) and the engine's
re-planning with the fitted profile (budget_follower)."""

import dataclasses
from pathlib import Path

import pytest

from vramshard import Engine, budget_follower
from vramshard.errors import InvalidInputError
from vramshard.plan import calibrate
from vramshard.plan.calibrate import fit, step_seconds
from vramshard.plan.memory import workspace_bytes
from vramshard.plan.planner import Planner
from vramshard.plan.tiers import Tiers
from vramshard.profile import load
from vramshard.profile.query import synthetic
from vramshard.runtime.plan_check import MIN_STEPS
from vramshard.shapes import shape_model

H200 = Path(__file__).resolve().parent.parent / "docs" / "profiles" / "h200-queued.json"
GiB = 2**30
TIERS = Tiers((1, 4, 16))


@pytest.fixture(scope="module")
def h200():
    return load(H200, check_fingerprint=False)


@pytest.fixture(scope="module")
def nemo_2gib(h200):
    """nemo-8b's tier-1 plan at 2 GiB on the H200 profile: it splits FFNs between CPU and GPU."""
    model = shape_model("nemo-8b")
    plan = Planner(model, h200, 2 * GiB, context=1088, tiers=Tiers((1,))).plan()
    assert plan.tiers[1].placement.split_names()
    return model, plan


def only(plan, family):
    """``plan`` with its tier 1 running ``family``'s placement."""
    tier = plan.tiers[1]
    return dataclasses.replace(plan, tiers={1: dataclasses.replace(tier, placement=tier.placements[family],
                                                                   threads=None)})


def test_a_calibrated_profile_scales_cpu_compute_and_nothing_else(h200):
    fitted = h200.calibrated(1.5, split_part_scale=2.0)
    assert fitted.matmul_s(1, 4096, 14336, "bf16", "cpu") == pytest.approx(1.5 * h200.matmul_s(1, 4096, 14336, "bf16", "cpu"))
    assert fitted.attention_s(1, 4096, 32, 8, 128, "bf16", "cpu") == \
        pytest.approx(1.5 * h200.attention_s(1, 4096, 32, 8, 128, "bf16", "cpu"))
    assert fitted.matmul_s(1, 4096, 14336, "bf16", "cuda") == h200.matmul_s(1, 4096, 14336, "bf16", "cuda")
    assert fitted.transfer_s(2**26) == h200.transfer_s(2**26)
    assert fitted.dispatch_s("cuda") == h200.dispatch_s("cuda")
    assert fitted.split_part_factor("fp16") == pytest.approx(2.0 * h200.split_part_factor("fp16"))
    assert (h200.cpu_scale, h200.split_part_scale) == (1.0, 1.0)  # the original is kept
    assert fitted.calibrated(2.0).cpu_scale == pytest.approx(3.0)  # factors compose
    for bad in (0, -1, float("nan")):
        with pytest.raises(InvalidInputError, match="cpu_scale"):
            h200.calibrated(bad)
        with pytest.raises(InvalidInputError, match="split_part_scale"):
            h200.calibrated(split_part_scale=bad)


def test_a_split_plan_slower_than_predicted_is_explained_by_its_cpu_parts(nemo_2gib, h200):
    model, plan = nemo_2gib
    predicted = plan.tiers[1].predicted_s
    fitted = fit(model, h200, plan, 1.4 * predicted)
    assert fitted.what == "split_part_scale" and 1.2 < fitted.value < calibrate.HIGHEST
    assert fitted.profile.cpu_scale == 1.0
    assert step_seconds(model, fitted.profile, plan, 1) == pytest.approx(1.4 * predicted, rel=calibrate.TOLERANCE)
    # Faster than its copies allow: no CPU factor explains that.
    assert fit(model, h200, plan, 0.5 * predicted) is None
    # The factor is charged to plans that split, not to one that streams every FFN.
    streamed = only(plan, "gpu-only")
    assert step_seconds(model, fitted.profile, streamed, 1) == pytest.approx(step_seconds(model, h200, streamed, 1))


def test_a_cpu_plan_without_splits_gets_a_cpu_factor_and_a_gpu_plan_nothing(nemo_2gib, h200):
    model, plan = nemo_2gib
    static = only(plan, "static")
    assert not static.tiers[1].placement.split_names()
    measured = 1.3 * step_seconds(model, h200, static, 1)
    fitted = fit(model, h200, static, measured)
    assert fitted.what == "cpu_scale" and fitted.value > 1.1
    assert step_seconds(model, fitted.profile, static, 1) == pytest.approx(measured, rel=calibrate.TOLERANCE)
    resident = Planner(model, h200, 40 * GiB, context=1088, tiers=Tiers((1,))).plan()
    assert fit(model, h200, resident, 2 * resident.tiers[1].predicted_s) is None  # nothing of it on the CPU path


# ---------------------------------------------------------------------------- the engine
def simulated_engine(model_dir):
    """A tiny qwen3 on a simulated GPU whose plan computes on the CPU (fast CPU, slow PCIe)."""
    profile = synthetic(cpu_gflops=2000, gpu_gflops=20_000, h2d_gbps=0.5, cpu_threads=2)
    reference = Engine.load(model_dir, device="cpu")
    probe = Planner(reference.model, profile, None, context=256, tiers=TIERS)
    part = workspace_bytes(reference.model, TIERS.largest, 256) + 2 * probe.slot_bytes + probe.kv_bytes() \
        + reference.model.nbytes // 3
    engine = Engine.load(model_dir, vram=part, simulate_gpu=True, profile=profile, tiers=TIERS, max_step_tokens=16,
                         max_context=128, max_batch=2)
    assert calibrate.has_cpu_work(engine.plan, 1)
    return engine, reference


def slow_steps(engine, factor: float) -> None:
    """The plan in force's check, as if its decode steps had run ``factor`` times its prediction."""
    check = engine.plan_check()
    for _ in range(MIN_STEPS):
        check.add(1, 1, factor * check.predicted_s)


def test_an_engine_off_its_prediction_fits_the_profile_and_plans_again(tiny_model_dir):
    engine, reference = simulated_engine(tiny_model_dir("qwen3"))
    prompt = [5, 9, 11, 13, 2, 7]
    expected = reference.generate([prompt], 8)
    old_plan, old_profile = engine.plan, engine.budget.plan_settings().profile
    engine.poll_budget()
    assert engine.budget.calibrations == []  # no steps measured yet
    slow_steps(engine, 1.2)  # the tiny model's CPU share is small: 1.2x takes a large factor
    engine.poll_budget()
    (fitted,) = engine.budget.calibrations
    assert fitted["measured_s"] == pytest.approx(1.2 * fitted["predicted_s"]) and fitted["cpu_scale"] > 1.5
    assert engine.budget.plan_settings().profile.cpu_scale == pytest.approx(fitted["cpu_scale"])
    assert old_profile.cpu_scale == 1.0
    engine.budget.background.wait(60)
    engine.poll_budget()  # the plan made with the fitted profile comes into force at a step boundary
    assert engine.budget.events[-1]["why"] == "calibrate"
    assert engine.budget_state()["calibrations"] == [fitted]  # what /v1/budget shows
    assert engine.plan is not old_plan
    assert engine.plan.tiers[1].predicted_s > old_plan.tiers[1].predicted_s
    assert engine.generate([prompt], 8) == expected
    engine.poll_budget()
    assert len(engine.budget.calibrations) == 1  # the new plan is checked afresh, from no steps


def test_calibration_stays_off_when_asked_and_within_the_tolerance(tiny_model_dir, monkeypatch):
    engine, _ = simulated_engine(tiny_model_dir("qwen3"))
    slow_steps(engine, 1.1)  # inside CALIBRATE_OFF_BY
    engine.poll_budget()
    assert engine.budget.calibrations == []
    slow_steps(engine, 100.0)  # beyond what any CPU factor explains: left alone
    engine.poll_budget()
    assert engine.budget.calibrations == [] and engine.budget.refine is None
    monkeypatch.setattr(budget_follower, "CALIBRATE", False)
    engine, _ = simulated_engine(tiny_model_dir("qwen3"))
    slow_steps(engine, 1.2)
    engine.poll_budget()
    assert engine.budget.calibrations == [] and engine.budget.refine is None


def test_a_gap_the_cpu_cannot_explain_is_not_fitted(h200):
    """qwen3-30b-a3b streaming its experts computes only the embedding gather on the CPU: a step
    twice its prediction is not the CPU's doing, and no factor is made up for it."""
    model = shape_model("qwen3-30b-a3b")
    plan = Planner(model, h200, 16 * GiB, context=1088, tiers=Tiers((1,))).plan()
    assert not plan.tiers[1].placement.split_names()
    assert fit(model, h200, plan, 2 * plan.tiers[1].predicted_s) is None
