"""Fitting the machine profile to measured decode steps (plan/calibrate.py) and the engine's
re-planning with the fitted profile (budget_follower)."""

import dataclasses
import json
import time
from pathlib import Path

import pytest
import torch

from vramshard import Engine, budget_follower
from vramshard.errors import InvalidInputError
from vramshard.layers import cpu_linear
from vramshard.plan import calibrate
from vramshard.plan.calibrate import fit, step_seconds
from vramshard.plan.estimator import Estimator
from vramshard.plan.memory import sublayer_triples, workspace_bytes
from vramshard.plan.placement import named_placement
from vramshard.plan.planner import Planner
from vramshard.plan.tiers import Tiers
from vramshard.profile import load
from vramshard.profile.query import synthetic
from vramshard.plan.calibrate import context_scale, scale_points
from vramshard.runtime.plan_check import MIN_STEPS, CpuCheck, DecodeCheck, cpu_samples_needed
from vramshard.runtime.scheduler import StepStats
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


def test_a_calibration_slows_the_cpu_pass_over_host_experts_too():
    """The compiled pass over a MoE layer's host experts is CPU compute: a fitted CPU factor slows
    it as it slows the matmuls (before, its rate ignored the factors, so no calibration could
    explain a MoE step whose experts ran slower on the CPU than profiled)."""
    run15 = load(H200.with_name("h200-run15.json"), check_fingerprint=False)  # it timed the pass
    fitted = run15.calibrated(1.5, cpu_rows={1: 1.2})
    assert fitted.host_experts_rate("bf16", 1) == pytest.approx(run15.host_experts_rate("bf16", 1) / 1.8)
    model = shape_model("qwen3-30b-a3b")
    moe = next(s for s in model if s.kind == "ffn")
    alone = Estimator(model, run15).experts_s(moe, "cpu", 1)
    assert Estimator(model, fitted).experts_s(moe, "cpu", 1) == pytest.approx(1.8 * alone)
    experts_cpu = named_placement("experts-cpu", sublayer_triples(model), model.args.num_hidden_layers,
                                  moe_layers=[s.layer for s in model if s.kind == "ffn"])
    before = Estimator(model, run15, zero_copy=False).simulate(experts_cpu, 1, 1024)
    after = Estimator(model, fitted, zero_copy=False).simulate(experts_cpu, 1, 1024)
    assert after.cpu_busy > 1.7 * before.cpu_busy and after.seconds > before.seconds


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
def simulated_engine(model_dir, device: str | None = None):
    """A tiny qwen3 on a simulated GPU (``device`` "cuda": the real one) whose plan computes on the CPU
    (fast CPU, slow PCIe)."""
    profile = synthetic(cpu_gflops=2000, gpu_gflops=20_000, h2d_gbps=0.5, cpu_threads=2)
    reference = Engine.load(model_dir, device="cpu")
    probe = Planner(reference.model, profile, None, context=256, tiers=TIERS)
    part = workspace_bytes(reference.model, TIERS.largest, 256) + 2 * probe.slot_bytes + probe.kv_bytes() \
        + reference.model.nbytes // 3
    where = {"device": device} if device else {"simulate_gpu": True}
    engine = Engine.load(model_dir, vram=part, profile=profile, tiers=TIERS, max_step_tokens=16,
                         max_context=128, max_batch=2, **where)
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


@pytest.mark.parametrize("device", [None, pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_fits_quick_plan_comes_into_force_while_its_full_plan_is_made(tiny_model_dir, monkeypatch, device):
    """After a fit the background thread makes the quick plan first: it comes into force at the next step
    boundary (recorded as the calibration, ``quick_plan``), and the full plan follows as a "refine"; both
    keep the greedy tokens (on the GPU: its own before the fit) and plan within the VRAM budget."""
    import threading

    from vramshard.runtime import budget as budgets
    from vramshard.runtime import plan_process

    release, made = threading.Event(), []
    original = plan_process.make_plan_off_thread

    def make(model, settings, budget, kv_on_gpu=None, search=True):
        if search:
            release.wait(60)  # the full plan takes its time
        made.append(search)
        return original(model, settings, budget, kv_on_gpu, search)

    monkeypatch.setattr(plan_process, "make_plan_off_thread", make)
    engine, reference = simulated_engine(tiny_model_dir("qwen3"), device)
    prompt = [5, 9, 11, 13, 2, 7]
    if device:  # the GPU's own tokens, its real steps neither fitted nor kept as the fit's samples
        monkeypatch.setattr(budget_follower, "CALIBRATE", False)
        expected = engine.generate([prompt], 8)
        monkeypatch.setattr(budget_follower, "CALIBRATE", True)
        engine.plan_check().measured.clear()
        engine.cpu_check().samples.clear()  # (timed CPU work is judged before a fit: the forty-second session)
    else:
        expected = reference.generate([prompt], 8)
    follower, old_plan = engine.budget, engine.plan
    slow_steps(engine, 1.2)
    engine.poll_budget()
    assert len(follower.calibrations) == 1 and follower.refine is not None
    key = (budgets.budget_key(follower.refine[0]), follower.refine[1])
    waited = time.monotonic()
    while follower.plan_cache.peek((*key, False)) is None and time.monotonic() - waited < 30:
        time.sleep(0.01)
    engine.poll_budget()
    quick = follower.plan_cache.peek((*key, False))
    assert made == [False] and engine.plan is quick and quick is not old_plan
    assert follower.events[-1]["why"] == "calibrate" and follower.events[-1]["quick_plan"]
    assert follower.refine is not None  # the full plan still to come
    assert engine.generate([prompt], 8) == expected
    release.set()
    follower.background.wait(60)
    engine.poll_budget()
    assert made[:2] == [False, True] and follower.refine is None
    assert engine.plan is follower.plan_cache.peek((*key, True))
    assert engine.generate([prompt], 8) == expected
    assert engine.executor.need.total <= engine.vram_budget  # (the plan's need: a tiny model's reserved VRAM
    # rounds up to the allocator's blocks, far above its few MiB of budget)


@pytest.mark.parametrize("recent, one_token, others, comes_in", [
    ([], 0.8, 1.0, True),  # no steps yet: one-token steps weigh, and the quick plan's are 0.8x
    ([], 0.95, 1.0, False),
    ([16] * 30 + [1] * 10, 0.8, 1.0, False),  # the engine's steps mostly of tier 16, where it gains nothing
    ([16] * 30 + [1] * 10, 0.8, 0.85, True),
])
def test_a_fits_quick_plan_comes_into_force_only_where_it_is_predicted_faster(tiny_model_dir, monkeypatch, recent,
                                                                           one_token, others, comes_in):
    """A quick plan no faster than the plan in force (under the fitted profile, over the engine's recent steps
    by tier) would only add a switch before the full plan's (in the forty-fourth GPU session the quick plan of
    llama3-8b at 8 GiB unpinned 30 sub-layers that the full one pinned 1.8 s later): the plan in force goes on
    until the full plan."""
    import threading

    from vramshard.runtime import budget as budgets
    from vramshard.runtime import plan_process

    release = threading.Event()
    original = plan_process.make_plan_off_thread

    def make(model, settings, budget, kv_on_gpu=None, search=True):
        if search:
            release.wait(60)
        return original(model, settings, budget, kv_on_gpu, search)

    monkeypatch.setattr(plan_process, "make_plan_off_thread", make)
    engine, _ = simulated_engine(tiny_model_dir("qwen3"))
    follower, old_plan = engine.budget, engine.plan
    predicted = calibrate.step_seconds

    def step_seconds(model, profile, plan, tier):  # the quick plan's steps as the parameters have them
        if plan is follower.plan_cache.peek((*key, False)):
            return (one_token if tier == 1 else others) * predicted(model, profile, old_plan, tier)
        return predicted(model, profile, plan, tier)

    slow_steps(engine, 1.2)
    engine.poll_budget()
    key = (budgets.budget_key(follower.refine[0]), follower.refine[1])
    follower.recent_tiers.extend(recent)
    monkeypatch.setattr(calibrate, "step_seconds", step_seconds)
    waited = time.monotonic()
    while follower.plan_cache.peek((*key, False)) is None and time.monotonic() - waited < 30:
        time.sleep(0.01)
    engine.poll_budget()
    if comes_in:
        assert engine.plan is follower.plan_cache.peek((*key, False)) and follower.events[-1]["quick_plan"]
    else:
        assert engine.plan is old_plan and follower.events[-1]["quick_plan_skipped"]
        assert follower.events[-1]["quick_predicted_s"] > follower.events[-1]["in_force_predicted_s"] / 1.1
    assert follower.refine is not None  # the full plan still to come, either way
    release.set()
    follower.background.wait(60)
    engine.poll_budget()
    assert follower.refine is None and engine.plan is follower.plan_cache.peek((*key, True))


def test_an_engines_steps_are_kept_by_tier_for_weighing_a_quick_plan(tiny_model_dir):
    engine, _ = simulated_engine(tiny_model_dir("qwen3"))
    engine.generate([[5, 9, 11, 13, 2, 7]], 4)  # a 6-token prompt (tier 16), then one-token steps
    assert list(engine.budget.recent_tiers)[:2] == [16, 1] and set(engine.budget.recent_tiers) == {1, 16}


def test_a_re_plan_that_decodes_slower_than_the_plan_it_replaced_gives_way_to_it(tiny_model_dir):
    """A fit can explain a slow spell of the host rather than the machine: when the plan it led to
    decodes more than REVERT_OFF_BY slower than the plan measured before under the same budget,
    that plan comes back, with its profile, and no fit chases it again."""
    engine, reference = simulated_engine(tiny_model_dir("qwen3"))
    prompt = [5, 9, 11, 13, 2, 7]
    expected = reference.generate([prompt], 8)
    old_plan, old_profile = engine.plan, engine.budget.plan_settings().profile
    slow_steps(engine, 1.2)
    engine.poll_budget()
    assert engine.budget.plan_settings().profile is not old_profile  # fitted; the new plan is being made
    engine.budget._revert_if_slower(engine.plan_check())  # the old plan's steps, seen again meanwhile
    (best,) = engine.budget.fastest.values()
    assert best.plan is old_plan and best.profile is old_profile  # the profile it ran under, not the fit
    engine.budget.background.wait(60)
    engine.poll_budget()
    assert engine.plan is not old_plan and not budget_follower.same_placements(engine.plan, old_plan)
    before = 1.2 * old_plan.tiers[1].predicted_s  # the old plan's measured median
    check = engine.plan_check()
    for _ in range(budget_follower.REVERT_MIN_STEPS - 1):  # far slower, but too few steps to judge
        check.add(1, 1, 2.0 * before)
    engine.poll_budget()
    assert engine.plan is not old_plan
    check.measured.clear()
    for _ in range(budget_follower.REVERT_MIN_STEPS):  # slower than the old plan, but within REVERT_OFF_BY
        check.add(1, 1, 0.99 * budget_follower.REVERT_OFF_BY * before)
    engine.poll_budget()
    assert engine.plan is not old_plan and engine.budget.events[-1]["why"] == "calibrate"
    for _ in range(2 * budget_follower.REVERT_MIN_STEPS):
        check.add(1, 1, 1.3 * before)
    engine.poll_budget()
    assert engine.plan is old_plan and engine.budget.events[-1]["why"] == "revert"
    assert engine.budget.plan_settings().profile is old_profile
    fit, revert = engine.budget.calibrations
    assert "cpu_scale" in fit and revert["reverted_to_measured_s"] == pytest.approx(before)
    assert revert["measured_s"] == pytest.approx(1.3 * before)
    assert engine.generate([prompt], 8) == expected
    slow_steps(engine, 1.2)  # the plan back in force is off its prediction again: not fitted again
    engine.poll_budget()
    assert len(engine.budget.calibrations) == 2 and engine.budget.refine is None


def test_a_re_plan_that_decodes_faster_becomes_the_one_to_beat(tiny_model_dir):
    engine, _ = simulated_engine(tiny_model_dir("qwen3"))
    old_plan = engine.plan
    slow_steps(engine, 1.2)
    engine.poll_budget()
    engine.budget.background.wait(60)
    engine.poll_budget()
    new_plan = engine.plan
    assert new_plan is not old_plan
    before = 1.2 * old_plan.tiers[1].predicted_s
    check = engine.plan_check()
    for _ in range(MIN_STEPS):
        check.add(1, 1, 0.8 * before)
    engine.poll_budget()
    (best,) = engine.budget.fastest.values()
    assert best.plan is new_plan and best.median_s == pytest.approx(0.8 * before)
    assert engine.plan is new_plan and engine.budget.events[-1]["why"] == "calibrate"


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


# ---------------------------------------------------------------------------- CPU work measured directly
def test_cpu_factors_by_rows_interpolate_in_log_rows_and_compose(h200):
    fitted = h200.calibrated(cpu_rows={16: 1.5, 64: 3.0})
    assert h200.cpu_row_factor(7) == 1.0 and h200.cpu_rows == ()  # the original is kept
    assert fitted.cpu_row_factor(16) == 1.5 and fitted.cpu_row_factor(64) == 3.0
    assert fitted.cpu_row_factor(32) == pytest.approx(2.25)  # halfway in log rows
    assert fitted.cpu_row_factor(8) == 1.5  # the nearest beyond them
    assert fitted.cpu_row_factor(4096) == 1.0  # no decode rows' factor on prompt chunks (the next test)
    assert fitted.matmul_s(32, 4096, 14336, "bf16", "cpu") == pytest.approx(2.25 * h200.matmul_s(32, 4096, 14336, "bf16", "cpu"))
    assert fitted.attention_s(64, 4096, 32, 8, 128, "bf16", "cpu") == \
        pytest.approx(3.0 * h200.attention_s(64, 4096, 32, 8, 128, "bf16", "cpu"))
    assert fitted.matmul_s(8, 4096, 14336, "bf16", "cuda") == h200.matmul_s(8, 4096, 14336, "bf16", "cuda")
    assert fitted.calibrated(cpu_rows={64: 0.5}).cpu_row_factor(64) == pytest.approx(1.5)  # on top of 3.0
    for bad in ({1: 0.0}, {0: 1.2}, {1: float("inf")}):
        with pytest.raises(InvalidInputError):
            h200.calibrated(cpu_rows=bad)


def test_factors_fitted_at_decode_rows_and_at_prompt_rows_stay_on_their_side(h200):
    """The C kernel's few rows (KERNEL_ROWS), the rest of a decode step (up to DECODE_ROWS rows) and
    prompt chunks run other code on the CPU: a factor fitted in one class is not carried to another (a
    64-row factor of 0.5 made the planner split a 1024-row tier whose CPU work then took 3.6x its
    prediction; 64-row factors of 1.2-4.0 priced one-row CPU layers so), within a class the nearest applies."""
    from vramshard.profile.query import DECODE_ROWS, KERNEL_ROWS

    decode = h200.calibrated(cpu_rows={1: 1.5, DECODE_ROWS: 0.5}, split_rows={DECODE_ROWS: 0.5})
    for rows in (DECODE_ROWS + 1, 256, 1024):
        assert decode.cpu_row_factor(rows) == 1.0 and decode.split_row_factor(rows) == 1.0
        assert decode.matmul_s(rows, 4096, 14336, "bf16", "cpu") == h200.matmul_s(rows, 4096, 14336, "bf16", "cpu")
    assert decode.split_row_factor(16) == 0.5 and decode.cpu_row_factor(DECODE_ROWS) == 0.5
    both = decode.calibrated(cpu_rows={1024: 1.8})
    assert both.cpu_row_factor(256) == both.cpu_row_factor(2048) == 1.8 and both.cpu_row_factor(DECODE_ROWS) == 0.5
    assert both.cpu_row_factor(KERNEL_ROWS) == 1.5 and both.cpu_row_factor(KERNEL_ROWS + 1) == 0.5
    only_64 = h200.calibrated(cpu_rows={DECODE_ROWS: 4.0}, split_rows={DECODE_ROWS: 2.0})
    assert only_64.cpu_row_factor(1) == only_64.split_row_factor(KERNEL_ROWS) == 1.0
    assert only_64.matmul_s(1, 4096, 14336, "bf16", "cpu") == h200.matmul_s(1, 4096, 14336, "bf16", "cpu")


def test_measured_cpu_work_fits_a_factor_at_its_tier_rows(nemo_2gib, h200):
    model, plan = nemo_2gib
    predicted = calibrate.cpu_seconds(model, h200, plan, 1)
    fitted = calibrate.fit_cpu_rows(model, h200, plan, {1: 1.4 * predicted})
    assert fitted.what == "cpu_rows" and 1.3 < fitted.value[1] < 1.5
    assert calibrate.cpu_seconds(model, fitted.profile, plan, 1) == pytest.approx(1.4 * predicted, rel=0.02)
    assert step_seconds(model, fitted.profile, plan, 1) > step_seconds(model, h200, plan, 1)
    assert calibrate.fit_cpu_rows(model, h200, plan, {1: 1.1 * predicted}) is None  # within CPU_OFF_BY
    assert calibrate.fit_cpu_rows(model, h200, plan, {64: 2 * predicted}) is None  # no such tier in the plan
    resident = Planner(model, h200, 40 * GiB, context=1088, tiers=Tiers((1,))).plan()
    assert calibrate.fit_cpu_rows(model, h200, resident, {1: 0.05}) is None  # no CPU work to scale


def test_cpu_work_beyond_every_factor_considered_is_not_fitted(nemo_2gib, h200):
    """A step far off any factor (an engine's first prompt chunk ran 17x its prediction on the
    H200 machine) would be fitted at the limit and spread to every tier's rows: it is left out."""
    model, plan = nemo_2gib
    predicted = calibrate.cpu_seconds(model, h200, plan, 1)
    assert calibrate.fit_cpu_rows(model, h200, plan, {1: 20 * predicted}) is None
    assert calibrate.fit_cpu_rows(model, h200, plan, {1: 0.1 * predicted}) is None
    assert calibrate.fit_cpu_rows(model, h200, plan, {1: 6 * predicted}).value[1] > 5  # inside: fitted


def test_a_tiers_first_step_under_a_plan_is_its_warm_up_not_a_sample():
    check = CpuCheck(plan=object())
    check.add(1024, 0.25)  # first calls, first touches
    assert check.ready() == {} and check.samples == {}
    check.add(1024, 0.016)
    assert check.ready() == {1024: 0.016}
    for _ in range(cpu_samples_needed(1)):
        check.add(1, 0.02)
    assert check.ready() == {1024: 0.016}  # tier 1's first step did not count: one short
    check.add(1, 0.02)
    assert check.ready() == {1024: 0.016, 1: 0.02}


def test_later_engines_start_from_what_an_earlier_one_fitted(nemo_2gib, h200):
    model, plan = nemo_2gib
    calibrate.forget_learned()
    try:
        fitted = calibrate.fit_cpu_rows(model, h200, plan, {1: 2 * calibrate.cpu_seconds(model, h200, plan, 1)})
        calibrate.learn(fitted.profile, model.dtype)
        assert calibrate.with_learned(h200, model.dtype).cpu_rows == fitted.profile.cpu_rows
        assert calibrate.with_learned(h200, "torch.float32") is h200  # another dtype: nothing learned
        made_up = synthetic(cpu_gflops=500, cpu_mem_gbps=40).calibrated(cpu_rows={1: 2.0})
        calibrate.learn(made_up, model.dtype)  # a synthetic profile measured nothing: not kept
        assert calibrate.with_learned(synthetic(cpu_gflops=500, cpu_mem_gbps=40), model.dtype).cpu_rows == ()
        calibrate.learn(h200, model.dtype)  # a revert to the profile unfitted: later engines start from it
        again = calibrate.with_learned(h200, model.dtype)
        assert again.cpu_rows == () and again.split_rows == () and again.dispatch_scale == 1.0
    finally:
        calibrate.forget_learned()


def test_fitted_factors_are_kept_for_later_processes_of_the_same_measured_profile(nemo_2gib, h200, monkeypatch,
                                                                                 caplog):
    """The calibration file (profile/learned.py): a later process (here: this one, its memory
    forgotten) starts from the factors fitted on the same measured profile; another measurement
    of the machine, a corrupt file or VRAMSHARD_CALIBRATION_STORE=off start from the profile."""
    from vramshard.profile import learned as learned_store

    model, plan = nemo_2gib
    fitted = calibrate.fit_cpu_rows(model, h200, plan, {1: 2 * calibrate.cpu_seconds(model, h200, plan, 1)})
    monkeypatch.setenv("VRAMSHARD_CALIBRATION_STORE", "on")
    calibrate.learn(fitted.profile.calibrated(dispatch_scale=1.8), model.dtype)
    stored = learned_store.path(h200.fingerprint_hash)
    assert stored.is_file()
    calibrate.forget_learned()  # a new process
    again = calibrate.with_learned(h200, model.dtype)
    assert again.cpu_rows == fitted.profile.cpu_rows and again.dispatch_scale == pytest.approx(1.8)
    calibrate.forget_learned()
    # A file from before the decode graphs were priced: its CPU factors hold, its dispatch factor does not.
    kept = json.loads(stored.read_text())
    stored.write_text(json.dumps({k: v for k, v in kept.items() if k != "dispatch_pricing"}))
    older = calibrate.with_learned(h200, model.dtype)
    assert older.cpu_rows == fitted.profile.cpu_rows and older.dispatch_scale == 1.0
    stored.write_text(json.dumps(kept))
    calibrate.forget_learned()
    remeasured = type(h200).from_dict({**h200.to_dict(), "created": "2027-01-01T00:00:00"})
    assert calibrate.with_learned(remeasured, model.dtype) is remeasured  # factors of another measurement
    monkeypatch.setenv("VRAMSHARD_CALIBRATION_STORE", "off")
    assert calibrate.with_learned(h200, model.dtype) is h200
    monkeypatch.setenv("VRAMSHARD_CALIBRATION_STORE", "on")
    stored.write_text("{not json")
    with caplog.at_level("WARNING"):
        assert calibrate.with_learned(h200, model.dtype) is h200
    assert "ignoring" in caplog.text and str(stored) in caplog.text
    calibrate.learn(fitted.profile, model.dtype)  # the next fit replaces the unreadable file
    calibrate.forget_learned()
    assert calibrate.with_learned(h200, model.dtype).cpu_rows == fitted.profile.cpu_rows


def test_an_engine_whose_cpu_work_runs_slow_fits_that_tier_and_plans_again(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(calibrate, "MIN_CPU_S", 0.0)  # the tiny model's CPU work is far below a real one's
    engine, reference = simulated_engine(tiny_model_dir("qwen3"))
    prompt = [5, 9, 11, 13, 2, 7]
    expected = reference.generate([prompt], 8)
    old_plan, profile = engine.plan, engine.budget.plan_settings().profile
    predicted = calibrate.cpu_seconds(engine.model, profile, old_plan, 1)
    check = engine.cpu_check()
    for _ in range(8):  # the first is the tier's warm-up
        check.add(1, 2 * predicted)
    engine.poll_budget()
    assert engine.budget.calibrations == []  # one step short of judging tier 1
    check.add(1, 2 * predicted)
    check.add(4, 0.0)  # a step without CPU work is not a sample
    engine.poll_budget()
    (fitted,) = engine.budget.calibrations
    assert fitted["cpu_measured_s"] == {1: pytest.approx(2 * predicted)}
    assert fitted["cpu_rows"][1] > 2  # the launches in the CPU work are not scaled: the compute takes more
    now = engine.budget.plan_settings().profile
    assert now.cpu_row_factor(1) == pytest.approx(fitted["cpu_rows"][1])
    assert calibrate.cpu_seconds(engine.model, now, old_plan, 1) == pytest.approx(2 * predicted, rel=0.03)
    assert engine.plan_check().calibrated is False  # the whole-step fit is not charged the CPU's gap again
    engine.budget.background.wait(60)
    engine.poll_budget()
    assert engine.budget.events[-1]["why"] == "calibrate" and engine.plan is not old_plan
    assert engine.generate([prompt], 8) == expected
    check = engine.cpu_check()
    assert check.plan is engine.plan and check.judged == {1}  # a new check; tier 1 stays judged
    check.add(1, 10 * predicted)
    assert check.samples == {}  # once per tier and engine: no fit chases its own re-plans


def test_a_cpu_fit_keeps_the_plan_it_replaces_so_a_slower_re_plan_gives_way_to_it(tiny_model_dir, monkeypatch):
    """A fit of a tier's CPU work acts after nine decode steps, before REVERT_MIN_STEPS: the plan it
    replaces is kept with the steps it ran until the new plan came in, so a re-plan that decodes slower
    goes back to it (the thirty-third GPU session: llama3-8b at 8 GiB went from 70-76 ms decode steps
    to 103-141 ms under such a fit, and stayed there)."""
    monkeypatch.setattr(calibrate, "MIN_CPU_S", 0.0)  # the tiny model's CPU work is far below a real one's
    engine, reference = simulated_engine(tiny_model_dir("qwen3"))
    prompt = [5, 9, 11, 13, 2, 7]
    expected = reference.generate([prompt], 8)
    old_plan, old_profile = engine.plan, engine.budget.plan_settings().profile
    steps = engine.plan_check()
    before = steps.predicted_s
    for _ in range(budget_follower.RECORD_MIN_STEPS + 1):
        steps.add(1, 1, 1.1 * before)
    predicted = calibrate.cpu_seconds(engine.model, old_profile, old_plan, 1)
    cpu = engine.cpu_check()
    for _ in range(9):  # (the first is the tier's warm-up)
        cpu.add(1, 2 * predicted)
    engine.poll_budget()
    (fitted,) = engine.budget.calibrations
    assert "cpu_rows" in fitted
    (best,) = engine.budget.fastest.values()
    assert best.plan is old_plan and best.profile is old_profile and best.median_s == pytest.approx(1.1 * before)
    for _ in range(2 * budget_follower.RECORD_MIN_STEPS):  # the old plan runs on while the new one is made
        steps.add(1, 1, 0.9 * before)
    engine.budget.background.wait(60)
    engine.poll_budget()
    assert engine.budget.events[-1]["why"] == "calibrate" and engine.plan is not old_plan
    assert not budget_follower.same_tier_steps(engine.plan, old_plan, 1)
    assert best.median_s == pytest.approx(0.9 * before)  # refreshed by the steps it ran meanwhile
    check = engine.plan_check()
    for _ in range(budget_follower.REVERT_MIN_STEPS):
        check.add(1, 1, 1.2 * before)  # 1.33x the old plan's steps
    engine.poll_budget()
    assert engine.plan is old_plan and engine.budget.events[-1]["why"] == "revert"
    assert engine.budget.plan_settings().profile is old_profile
    assert engine.generate([prompt], 8) == expected


def test_a_plan_with_too_few_steps_is_not_kept_when_a_fit_replaces_it(tiny_model_dir, monkeypatch):
    """Fewer than RECORD_MIN_STEPS decode steps are no measure of a plan: the fit replaces it and
    keeps nothing."""
    monkeypatch.setattr(calibrate, "MIN_CPU_S", 0.0)
    engine, _ = simulated_engine(tiny_model_dir("qwen3"))
    steps = engine.plan_check()
    for _ in range(budget_follower.RECORD_MIN_STEPS - 1):
        steps.add(1, 1, steps.predicted_s)
    predicted = calibrate.cpu_seconds(engine.model, engine.budget.plan_settings().profile, engine.plan, 1)
    cpu = engine.cpu_check()
    for _ in range(9):
        cpu.add(1, 2 * predicted)
    engine.poll_budget()
    assert len(engine.budget.calibrations) == 1 and engine.budget.fastest == {}


def test_steps_beside_a_background_plan_are_not_samples_of_the_cpu_work(tiny_model_dir):
    """The background planner's Python holds the GIL: steps that ran while it planned are slower
    on the host than the machine is, so they do not count."""
    engine, _ = simulated_engine(tiny_model_dir("qwen3"))

    def step(ended: float, seconds: float = 0.1):
        return StepStats(1, 0, 1, 1, 1, seconds, 0, 1, ended, seconds, 0.0, 0.05, 0.0)

    engine.budget.background.finished_at = time.time()
    engine._measured(step(time.time() + 0.5))  # the tier's first step under the plan: its warm-up
    engine._measured(step(time.time() + 0.05))  # began before the planner had finished
    assert engine.cpu_check().samples == {}
    engine._measured(step(time.time() + 0.5))
    assert list(engine.cpu_check().samples[1]) == [0.05]


def test_steps_in_which_cpu_projections_tried_their_paths_are_not_samples(tiny_model_dir):
    """A projection's first calls try each path in turn, the slow ones too: the steps that made
    such trials measure the trials, not the plan (llama3-8b's head on the H100 machine)."""
    engine, _ = simulated_engine(tiny_model_dir("qwen3"))

    def step(seconds: float = 0.1):
        return StepStats(1, 0, 1, 1, 1, seconds, 0, 1, time.time() + 0.5, seconds, 0.0, 0.05, 0.0)

    def trial():  # a shape no other call has made: its first call is a trial
        cpu_linear.cpu_linear(torch.ones(1, 24, dtype=torch.bfloat16), torch.ones(40, 24, dtype=torch.bfloat16))

    engine._measured(step())  # the tier's first step under the plan: its warm-up
    trial()
    engine._measured(step(0.2))
    engine._measured(step())
    assert list(engine.cpu_check().samples[1]) == [0.05]
    assert list(engine.plan_check().raw) == [0.1, 0.1]


def test_steps_in_which_the_worker_tried_another_team_are_not_samples(tiny_model_dir):
    """A step of the run-ahead worker's team on trial (runtime/team_tuner.py) times that team, which
    the engine may not go on with."""
    engine, _ = simulated_engine(tiny_model_dir("qwen3"))

    def step(seconds: float = 0.1):
        return StepStats(1, 0, 1, 1, 1, seconds, 0, 1, time.time() + 0.5, seconds, 0.0, 0.05, 0.0)

    engine._measured(step())  # the tier's first step under the plan: its warm-up
    engine.executor.team_trial_steps += 1  # (as the executor counts a step whose team is on trial)
    engine._measured(step(0.3))
    engine._measured(step())
    assert list(engine.cpu_check().samples[1]) == [0.05]
    assert list(engine.plan_check().raw) == [0.1, 0.1]


def bench_warm_up(engine, monkeypatch, trials: int = 0, replans: int = 0) -> list[int]:
    """The sizes of the runs `cli/bench.warm_up` makes, its runs' steps given to the engine
    as the scheduler gives them (a simulated GPU's steps time no CPU work), the first ``trials`` steps
    with a CPU path trial; the engine's background plan taking ``replans`` new plans, one a round."""
    from vramshard.cli import bench

    trials = iter(range(trials))
    monkeypatch.setattr(cpu_linear, "trial_calls", lambda: next(trials, -1))
    runs, plans = [], iter([dataclasses.replace(engine.plan) for _ in range(replans)])

    def run_requests(engine, prompts, new_tokens, settings):
        runs.append(len(prompts))
        for _ in range(1 + new_tokens):  # the prompt's step, then one a token
            engine.poll_budget()
            engine._measured(StepStats(len(prompts), 0, len(prompts), len(prompts), len(prompts), 0.1, 0, 1,
                                       time.time() + 0.5, 0.1, 0.0, 0.05, 0.0))
        return {"step_tokens": {len(prompts): 1 + new_tokens}}

    def wait(timeout):
        engine.plan = next(plans, engine.plan)  # (a fit's plan taken)

    monkeypatch.setattr(bench, "run_requests", run_requests)
    monkeypatch.setattr(engine.budget.background, "wait", wait)
    bench.warm_up(engine, bench.BenchSettings(pp=4, tg=64, batch_sizes=(4,), batch_prompt=4, batch_gen=8))
    return runs


def test_the_benchmarks_warm_up_runs_until_the_one_token_steps_are_judged(tiny_model_dir, monkeypatch):
    """`vramshard bench` and benchmarks/engine_bench measure an engine after a warm-up that let it fit
    its one-token steps' CPU work. Steps with CPU path trials are no samples, and an 8B model's head
    tried its paths through 10-15 decode steps, as long as one warm-up run: the warm-up goes on while
    the engine has that fit to make."""
    engine, _ = simulated_engine(tiny_model_dir("qwen3"))
    assert engine.calibration_pending() and engine.cpu_stats()["calibration_pending"] is True
    # (round 1: a one-token run of 35 steps (the 32 the decode judgment needs, and more), all trials, then 11
    # steps of four, 5 of them trials, then one more one-token run for the decode judgment; round 2: 11
    # one-token steps and 11 of four, and both tiers are judged)
    assert engine.budget.decode_steps_to_judge() == MIN_STEPS
    assert bench_warm_up(engine, monkeypatch, trials=40) == [1, 4, 1, 1, 4]
    assert engine.budget.decode_steps_to_judge() == 0  # (and its decode steps judged)
    assert not engine.calibration_pending() and 1 in engine.budget.cpu_judged
    assert engine.cpu_stats()["calibration_pending"] is False and 1 in engine.cpu_stats()["calibrated_tiers"]
    whole = Engine.load(tiny_model_dir("qwen3"), vram=2**30, simulate_gpu=True, tiers=TIERS, max_step_tokens=16,
                        max_context=128, profile=synthetic(cpu_gflops=2000, gpu_gflops=20_000, h2d_gbps=0.5))
    assert not calibrate.has_cpu_work(whole.plan, 1) and not whole.calibration_pending()  # (nothing to fit)


def test_the_benchmarks_warm_up_runs_a_plan_the_engine_took_in_it_before_the_timed_runs(tiny_model_dir, monkeypatch):
    """A fit's new plan pays its first calls in its first steps (253 ms of CPU work in a 1024-token
    step on the H200 machine, 16 ms after): the warm-up runs a round under it (up to WARMUP_ROUNDS)."""
    from vramshard.cli.bench import WARMUP_ROUNDS

    engine, _ = simulated_engine(tiny_model_dir("qwen3"))
    assert bench_warm_up(engine, monkeypatch) == [1, 4]  # (judged in the first round, no new plan)
    engine, _ = simulated_engine(tiny_model_dir("qwen3"))
    assert bench_warm_up(engine, monkeypatch, replans=1) == [1, 4, 1, 4]  # (with the new plan's 32 decode steps)
    engine, _ = simulated_engine(tiny_model_dir("qwen3"))
    assert bench_warm_up(engine, monkeypatch, replans=5) == [1, 4] * WARMUP_ROUNDS


def test_the_warm_up_waits_only_for_tiers_the_timed_runs_would_judge(tiny_model_dir):
    """A tier's CPU work is judged after its first step under a plan and 8 samples (1 from 256 tokens): a
    batch-1 run's 16-token prompt, one step a run, never reaches it in the timed runs, so it cannot re-plan
    them and the warm-up does not wait for it (it would run out its rounds); one stepped 9 times can."""
    from vramshard.cli import bench

    check = CpuCheck("plan")
    assert check.steps_to_judge(16) == 1 + cpu_samples_needed(16) and check.steps_to_judge(1024) == 2
    check.add(16, 0.01)
    check.add(1024, 0.02)
    assert check.steps_to_judge(16) == cpu_samples_needed(16) and check.steps_to_judge(1024) == 1
    check.judged.add(16)
    assert check.steps_to_judge(16) == 0
    engine, _ = simulated_engine(tiny_model_dir("qwen3"))
    steps = engine.cpu_steps_to_judge(16)
    assert steps == 1 + cpu_samples_needed(16)
    assert "tier 16's CPU work" not in bench._still_to_judge(engine, {16: steps - 1})
    assert "tier 16's CPU work" in bench._still_to_judge(engine, {16: steps})
    assert "tier 16's CPU work" in bench._still_to_judge(engine, {9: 1, 16: steps - 1})  # (both tier 16's)
    assert bench._still_to_judge(engine, {})[-1] == f"{MIN_STEPS} more one-token decode steps"


def test_the_benchmarks_warm_up_decodes_what_the_judgment_needs_within_the_runs_context(tiny_model_dir):
    """The decode judgment takes 32 steps, more than the context leaves after a long prompt (engine_bench:
    1024 + 32): the warm-up decodes what fits after it, then the rest after a short prompt, and the engine
    judges its decode steps before the timed runs (a smoke run of benchmarks/paired_decode.py found the
    warm-up asking for more tokens than the context holds, session 49)."""
    from vramshard.cli import bench

    engine, _ = simulated_engine(tiny_model_dir("qwen3"))
    settings = bench.BenchSettings(pp=100, tg=8, batch_sizes=(1,), batch_prompt=4, batch_gen=4)
    assert settings.max_context - settings.pp < MIN_STEPS
    bench.warm_up(engine, settings)
    assert engine.budget.decode_steps_to_judge() == 0 and len(engine.plan_check().measured) >= MIN_STEPS \
        or engine.plan_check().calibrated


def test_a_benchmark_cell_runs_whole_on_a_planned_engine_that_warms_up(tiny_model_dir):
    """`measure` (a cell of `vramshard bench` and engine_bench) end to end on a simulated GPU, where the warm-up
    runs (on a CPU engine it does not), with engine_bench's proportions: the decode judgment's 32 steps do not
    fit after the prompt."""
    from vramshard.cli import bench

    engine, _ = simulated_engine(tiny_model_dir("qwen3"))
    settings = bench.BenchSettings(pp=100, tg=8, batch_sizes=(1, 2), batch_prompt=4, batch_gen=4)
    result = bench.measure(engine, settings)
    assert result["tg_tok_s"] > 0 and result["ttft_s"] > 0
    assert set(result["batched"]) == {"1", "2"} and all(run["complete"] for run in result["batched"].values())


def test_the_benchmarks_warm_up_waits_for_the_plan_a_fit_made_in_its_own_poll_asks_for(monkeypatch):
    """The warm-up's poll after a round may judge a tier and ask for a plan (nothing switched yet): the
    warm-up waits for that plan, puts it in force and runs a round under it, so that the fit's switches
    do not fall in the timed runs (they did in the forty-third GPU session)."""
    from types import SimpleNamespace

    from vramshard.cli import bench

    rounds, polls = [], []
    new_plan = object()

    def poll_budget():
        polls.append(engine.budget.refine)
        if len(polls) == 1:
            engine.budget.refine = ("2 GiB", None)  # a fit judged in this poll: its plan is being made
        elif engine.budget.refine is not None:
            engine.plan, engine.budget.refine = new_plan, None  # the plan in force at the next poll

    engine = SimpleNamespace(device="cuda", args=SimpleNamespace(vocab_size=32), plan=object(),
                             budget=SimpleNamespace(refine=None, background=SimpleNamespace(wait=lambda timeout: None)),
                             poll_budget=poll_budget, calibration_pending=lambda tokens=1: False,
                             executor=SimpleNamespace(plans=SimpleNamespace(name="planned")))
    def run_requests(engine, prompts, tokens, settings):
        rounds.append(len(prompts))
        return {"step_tokens": {len(prompts): 1 + tokens}}

    monkeypatch.setattr(bench, "run_requests", run_requests)
    bench.warm_up(engine, bench.BenchSettings(pp=4, tg=8, batch_sizes=(1,), batch_prompt=4, batch_gen=8))
    assert engine.plan is new_plan and engine.budget.refine is None
    assert len(polls) == 3 and rounds == [1, 1, 1, 1]  # two rounds: the second under the fit's plan


def test_a_dispatch_factor_scales_the_hosts_gpu_dispatch_and_explains_a_host_bound_step(nemo_2gib, h200):
    fitted = h200.calibrated(dispatch_scale=2.0)
    assert fitted.dispatch_s("cuda") == pytest.approx(2 * h200.dispatch_s("cuda"))
    assert fitted.dispatch_s("cpu") == h200.dispatch_s("cpu")
    assert fitted.matmul_s(1, 4096, 4096, "bf16", "cpu") == h200.matmul_s(1, 4096, 4096, "bf16", "cpu")
    assert fitted.calibrated(dispatch_scale=1.5).dispatch_scale == pytest.approx(3.0)
    with pytest.raises(InvalidInputError, match="dispatch_scale"):
        h200.calibrated(dispatch_scale=0)
    model, plan = nemo_2gib
    # The split plan's host does its CPU parts and the GPU dispatch in turn: a slower dispatch
    # lengthens the step, and a factor on it explains a step 15% slower than predicted.
    measured = 1.15 * step_seconds(model, h200, plan, 1)
    fit = calibrate.fit_dispatch(model, h200, plan, measured)
    assert fit.what == "dispatch_scale" and fit.value > 1.2
    assert step_seconds(model, fit.profile, plan, 1) == pytest.approx(measured, rel=calibrate.TOLERANCE)
    assert calibrate.fit_dispatch(model, h200, plan, 0.5 * step_seconds(model, h200, plan, 1)) is None


@pytest.mark.parametrize("dispatch_fit", [True, False])
def test_with_its_cpu_work_timed_the_rest_of_a_slow_step_goes_to_the_dispatch(tiny_model_dir, monkeypatch,
                                                                              dispatch_fit):
    """VRAMSHARD_DISPATCH_FIT=off: the same slow steps fit nothing, and the plan stays."""
    monkeypatch.setattr(calibrate, "MIN_CPU_S", 0.0)
    monkeypatch.setattr(budget_follower, "DISPATCH_FIT", dispatch_fit)
    calibrate.forget_learned()
    engine, reference = simulated_engine(tiny_model_dir("qwen3"))
    profile = engine.budget.plan_settings().profile
    check = engine.cpu_check()
    for _ in range(9):  # the CPU work as predicted (after the tier's warm-up): judged, nothing to fit
        check.add(1, calibrate.cpu_seconds(engine.model, profile, engine.plan, 1))
    engine.poll_budget()
    assert engine.budget.calibrations == [] and check.judged == {1}
    plan = engine.plan
    slow_steps(engine, 1.2)
    engine.poll_budget()
    if not dispatch_fit:
        engine.poll_budget()
        assert engine.budget.calibrations == [] and engine.budget.refine is None and engine.plan is plan
        assert engine.budget.plan_settings().profile is profile
        return
    (fitted,) = engine.budget.calibrations
    assert fitted["dispatch_scale"] > 1.0 and "cpu_scale" not in fitted and "split_part_scale" not in fitted
    assert engine.budget.plan_settings().profile.dispatch_scale == pytest.approx(fitted["dispatch_scale"])


def test_one_measured_step_fits_its_cpu_work_then_the_dispatch(nemo_2gib, h200):
    model, plan = nemo_2gib
    cpu = calibrate.cpu_seconds(model, h200, plan, 1)
    step = step_seconds(model, h200, plan, 1)
    both = calibrate.fit_measured(model, h200, plan, 1, 1.5 * step, 1.3 * cpu)
    assert both.what == "cpu_rows+dispatch_scale" and 1.2 < both.value["cpu_rows"][1] < 1.4
    assert both.value["dispatch_scale"] > 1.0
    assert calibrate.cpu_seconds(model, both.profile, plan, 1) == pytest.approx(1.3 * cpu, rel=0.03)
    assert step_seconds(model, both.profile, plan, 1) == pytest.approx(1.5 * step, rel=2 * calibrate.TOLERANCE)
    # CPU work as predicted and a step within the tolerance: nothing to fit.
    assert calibrate.fit_measured(model, h200, plan, 1, 1.05 * step, cpu) is None
    # The CPU's gap alone explains the step: no dispatch factor on top.
    only_cpu = calibrate.fit_measured(model, h200, plan, 1, step_seconds(model, h200.calibrated(cpu_rows={1: 1.4}),
                                                                           plan, 1), 1.4 * cpu)
    assert only_cpu is not None and "dispatch_scale" not in only_cpu.value


def test_split_parts_slower_than_predicted_get_their_own_factor_and_whole_cpu_layers_keep_theirs(nemo_2gib, h200):
    """The fifteenth GPU session: split FFN parts' CPU work ran 1.6x its prediction while whole
    layers on the CPU ran as predicted. Timed apart, each is fitted on its own."""
    model, plan = nemo_2gib
    estimate = calibrate.step_estimate(model, h200, plan, 1)
    assert 0 < estimate.cpu_split_busy <= estimate.cpu_busy
    rest = estimate.cpu_busy - estimate.cpu_split_busy
    parts = 1.6 * estimate.cpu_split_busy
    fitted = calibrate.fit_cpu_rows(model, h200, plan, {1: rest + parts}, {1: parts})
    assert fitted.what == "split_rows" and fitted.profile.cpu_rows == ()
    # Above 1.6: the parts' launches are not scaled, so their compute takes more than the whole gap.
    assert 1.6 < fitted.profile.split_row_factor(1) < 1.8
    again = calibrate.step_estimate(model, fitted.profile, plan, 1)
    assert again.cpu_split_busy == pytest.approx(parts, rel=0.02)
    # (Their compute is the same; how much of it runs beside the copy engine, at the contended pace,
    # moves with the longer parts.)
    assert again.cpu_busy - again.cpu_split_busy == pytest.approx(rest, rel=0.02)
    # Whole layers on the CPU are priced as before; told only the total, the fit charges all CPU work.
    cpu_layers = named_placement("layers:2", sublayer_triples(model), model.args.num_hidden_layers)
    assert Estimator(model, fitted.profile, 16).simulate(cpu_layers, 1, 1088).cpu_busy == \
        pytest.approx(Estimator(model, h200, 16).simulate(cpu_layers, 1, 1088).cpu_busy)
    together = calibrate.fit_cpu_rows(model, h200, plan, {1: rest + parts})
    assert together.what == "cpu_rows" and together.profile.split_rows == ()


def test_the_rest_of_the_cpu_work_is_fitted_first_then_the_split_parts_on_top(h200, monkeypatch):
    monkeypatch.setattr(calibrate, "MIN_CPU_S", 0.0)  # the plan's CPU work beside its splits is small
    monkeypatch.setenv("VRAMSHARD_WIRE_CODEC", "off")  # (coded fills stream the sub-layer it computes on the CPU)
    model = shape_model("llama3-8b")
    plan = Planner(model, h200, 2 * GiB, context=1088, tiers=Tiers((1,))).plan()  # a sub-layer on the CPU too
    assert [n for n in plan.tiers[1].placement.names(compute="cpu") if n != "embed"]
    assert plan.tiers[1].placement.split_names()
    estimate = calibrate.step_estimate(model, h200, plan, 1)
    # The whole sub-layer on the CPU at twice its prediction, the split parts as predicted: the
    # factor on CPU compute (which the parts' matmuls take too) is offset for them by their own.
    rest, parts = 2.0 * (estimate.cpu_busy - estimate.cpu_split_busy), estimate.cpu_split_busy
    fitted = calibrate.fit_cpu_rows(model, h200, plan, {1: rest + parts}, {1: parts})
    assert fitted.what == "cpu_rows+split_rows" and fitted.profile.cpu_row_factor(1) > 1.5
    assert 0.4 < fitted.profile.split_row_factor(1) < 0.7
    again = calibrate.step_estimate(model, fitted.profile, plan, 1)
    # (Within 5%: CPU work beside the copies runs at the profile's contended rate, and which of it overlaps them
    # moves as the fitted factors change its length; 3.2% here since the staged attention's prefixes are copied in
    # place, session 63.)
    assert again.cpu_busy - again.cpu_split_busy == pytest.approx(rest, rel=0.05)
    assert again.cpu_split_busy == pytest.approx(parts, rel=0.05)
    # both are kept for later engines
    calibrate.forget_learned()
    try:
        calibrate.learn(fitted.profile, model.dtype)
        learned = calibrate.with_learned(h200, model.dtype)
        assert learned.split_rows == fitted.profile.split_rows and learned.cpu_rows == fitted.profile.cpu_rows
    finally:
        calibrate.forget_learned()


def test_a_check_keeps_the_split_parts_share_of_each_sample():
    check = CpuCheck(plan=object())
    for total, split in ((0.5, 0.4), (0.05, 0.03), (0.05, 0.04)):  # (the first is the warm-up)
        check.add(1024, total, split)
    assert check.ready() == {1024: 0.05} and check.split_of([1024]) == {1024: pytest.approx(0.035)}
    assert check.split_of([1]) == {}


def test_the_calibration_file_keeps_split_rows_and_reads_files_without_them(h200, tmp_path, monkeypatch):
    from vramshard.profile import learned as learned_store
    monkeypatch.setattr(learned_store, "cache_dir", lambda: tmp_path)
    data = h200.to_dict()
    key = data["fingerprint_hash"], str(data["created"])
    learned_store.write(*key, "torch.float16", (((1, 1.2),), 1.5, ((1, 1.6), (16, 1.3))))
    assert learned_store.read(*key, "torch.float16") == (((1, 1.2),), 1.5, ((1, 1.6), (16, 1.3)))
    stored = learned_store.path(key[0])
    data = json.loads(stored.read_text())
    del data["factors"]["torch.float16"]["split_rows"]  # a file written before split_rows existed
    stored.write_text(json.dumps(data))
    assert learned_store.read(*key, "torch.float16") == (((1, 1.2),), 1.5, ())


class DecodeSteps:
    """A plan's measured single-sequence decode steps, as the engine's plan check gives them."""

    def __init__(self, plan, median_s):
        self.plan, self.plan_name, self.tier, self.median = plan, "steps", 1, median_s

    def median_s(self):
        return self.median


def _another_placement(tier_plan):
    """Another family's placement of ``tier_plan``'s tier keeping the same sub-layers in VRAM."""
    vram = {n for n, w in tier_plan.placement.where if w.home == "vram"}
    family = next(f for f, p in tier_plan.placements.items() if p.where != tier_plan.placement.where
                  and {n for n, w in p.where if w.home == "vram"} == vram)
    return dataclasses.replace(tier_plan, family=family, placement=tier_plan.placements[family])


def test_a_re_plan_that_runs_the_measured_tier_alike_takes_the_record_and_is_not_reverted(tiny_model_dir):
    """Plans that differ only in other tiers decode alike: a slower median of the newer one (steps at a
    longer context, a busy spell) is not the plan's doing, so it takes the record instead of being
    reverted; one whose measured tier differs is judged against the record."""
    engine, _ = simulated_engine(tiny_model_dir("qwen3"))
    plan, follower = engine.plan, engine.budget
    largest = max(plan.tiers)
    elsewhere = dataclasses.replace(plan, tiers={**plan.tiers, largest: _another_placement(plan.tiers[largest])})
    assert not budget_follower.same_placements(plan, elsewhere)
    assert budget_follower.same_tier_steps(plan, elsewhere, 1)
    assert not budget_follower.same_tier_steps(plan, elsewhere, largest)

    assert not follower._revert_if_slower(DecodeSteps(plan, 0.100))
    assert not follower._revert_if_slower(DecodeSteps(elsewhere, 0.116))  # 1.16x, its tier-1 steps run as plan's
    (best,) = follower.fastest.values()
    assert best.plan is elsewhere and best.median_s == 0.116 and engine.plan is plan
    # A plan whose tier-1 steps differ is held to the record: 1.3x slower goes back to it.
    different = dataclasses.replace(plan, tiers={**plan.tiers, 1: _another_placement(plan.tiers[1])})
    assert follower._revert_if_slower(DecodeSteps(different, 1.3 * 0.116))
    assert engine.plan is elsewhere and engine.budget.events[-1]["why"] == "revert"


@pytest.mark.parametrize("vram_alike", [True, False])
def test_a_revert_keeps_what_other_tiers_cpu_work_was_fitted_to_since(tiny_model_dir, monkeypatch, vram_alike):
    """A revert judged at tier 1 gives up the profile the slower plan came from, but not what another
    tier's own CPU work was fitted to since (a batch's tier, judged after a dispatch fit): that factor
    stays in the profile, and that tier's placement of the plan in force stays where both plans lay out
    VRAM alike; tier 1 runs as the faster plan's, later engines start from that profile, and the tokens are
    the reference's."""
    learned = []
    monkeypatch.setattr(calibrate, "learn", lambda profile, dtype: learned.append(profile))
    engine, reference = simulated_engine(tiny_model_dir("qwen3"))
    prompt = [5, 9, 11, 13, 2, 7]
    expected = reference.generate([prompt], 8)
    plan, follower = engine.plan, engine.budget
    largest = max(plan.tiers)
    profile = follower.plan_settings().profile
    current = dataclasses.replace(plan, tiers={**plan.tiers, 1: _another_placement(plan.tiers[1]),
                                               largest: _another_placement(plan.tiers[largest])})
    if not vram_alike:
        current = dataclasses.replace(current, num_slots=current.num_slots + 1)

    assert not follower._revert_if_slower(DecodeSteps(plan, 0.100))  # the record
    fitted = profile.calibrated(cpu_rows={1: 1.3, largest: 1.8}, split_rows={largest: 1.2}, dispatch_scale=2.0)
    follower.settings = dataclasses.replace(follower.plan_settings(), profile=fitted)
    engine.plan = current
    assert follower._revert_if_slower(DecodeSteps(current, 0.130))
    now = follower.plan_settings().profile
    assert dict(now.cpu_rows) == {largest: pytest.approx(1.8)} and dict(now.split_rows) == {largest: pytest.approx(1.2)}
    assert now.dispatch_scale == profile.dispatch_scale  # the whole-step fit and tier 1's CPU fit given up
    assert budget_follower.same_tier_steps(engine.plan, plan, 1)
    assert budget_follower.same_tier_steps(engine.plan, current, largest) == vram_alike
    assert (engine.plan is plan) != vram_alike
    assert follower.calibrations[-1]["tiers_kept"] == ([largest] if vram_alike else [])
    assert learned[-1] is now
    assert engine.executor.plans.placements == engine.plan.tiered().placements
    assert engine.generate([prompt], 8) == expected


def test_decode_steps_are_taken_to_the_plans_context_before_they_are_judged(h200):
    """The plan predicts its step at the context it reserves (32K here, its KV cache in host
    memory); a step at a shorter context is scaled by how the estimator has the step grow with its
    context, so the check's median stands for a step at the plan's context, as its prediction does."""
    model = shape_model("nemo-8b")
    static = only(Planner(model, h200, 2 * GiB, context=32768, tiers=Tiers((1,)), search=False).plan(), "static")

    def estimated(context):
        return calibrate.step_estimate(model, h200, static, 1, context=context).seconds

    # (The context matters here: its prefix crosses PCIe each step, 1.5x the one-position step since the staging
    # copies a page-locked host cache in place, session 63; 3x with the host's gather before.)
    assert estimated(static.context) > 1.3 * estimated(1)
    check = DecodeCheck("static", static.tiers[1].predicted_s, 1, static,
                        context_scale({c: estimated(c) for c in scale_points(static.context)}, static.context))
    for context in (9, 1000, 8000, static.context, 40000):
        check.add(1, 1, estimated(context), context)
        assert check.measured[-1] == pytest.approx(estimated(static.context), rel=0.02)
        assert check.raw[-1] == estimated(context)
    check.add(1, 1, 0.5)  # (a context not known: taken as the plan's)
    assert check.measured[-1] == 0.5


def test_an_engine_says_each_decode_steps_context_to_its_check(tiny_model_dir):
    engine, _ = simulated_engine(tiny_model_dir("qwen3"))
    check = engine.plan_check()
    assert check.to_planned is not None and check.to_planned(engine.plan.context) == pytest.approx(1.0)
    seen = []
    check.to_planned = lambda context: seen.append(context) or 1.0
    engine.generate([[5, 9, 11, 13]], 4)
    assert seen == [5, 6, 7]  # (decode steps after the prompt's, which sampled the first token)
    cpu = engine.cpu_check()
    assert cpu.to_planned(1, engine.plan.context) == pytest.approx(1.0)


def test_a_tiers_cpu_work_is_taken_to_the_plans_context_but_its_split_parts_are_not():
    """Split FFN parts read no context; the rest of the CPU work (attention on the CPU) does."""
    check = CpuCheck("plan", to_planned=lambda tier, context: 2.0 if context < 100 else 1.0)
    for _ in range(3):
        check.add(4, 0.010, 0.004, context=50)  # (the first is not kept)
        check.add(4, 0.010, 0.004, context=500)
        check.add(4, 0.010, 0.004)
    assert sorted(set(check.samples[4])) == [pytest.approx(0.010), pytest.approx(0.016)]
    assert set(check.split_samples[4]) == {0.004}
