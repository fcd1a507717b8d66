"""Decode steps measured against the plan's prediction (runtime/plan_check.py, Engine.plan_check)."""

import logging

from vramshard import Engine
from vramshard.profile.query import synthetic
from vramshard.runtime import plan_check
from vramshard.runtime.plan_check import DecodeCheck


def test_a_plan_far_off_its_prediction_is_said_once(caplog):
    check = DecodeCheck("planned(1:search@1)", predicted_s=0.010)
    with caplog.at_level(logging.WARNING):
        for _ in range(plan_check.MIN_STEPS - 1):
            check.add(tokens=1, sequences=1, forward_s=0.030)
        check.add(tokens=16, sequences=16, forward_s=0.5)  # a batched step: not comparable, not counted
        check.add(tokens=7, sequences=1, forward_s=0.5)  # a prompt chunk: not counted
        assert not caplog.records
        for _ in range(10):
            check.add(tokens=1, sequences=1, forward_s=0.030)
    assert len([r for r in caplog.records if "re-run `vramshard profile`" in r.message]) == 1
    summary = check.summary()
    assert summary["steps"] == plan_check.MIN_STEPS + 9 and abs(summary["measured_over_predicted"] - 3.0) < 1e-9


def test_a_plan_close_to_its_prediction_is_not_flagged(caplog):
    check = DecodeCheck("planned", predicted_s=0.010)
    with caplog.at_level(logging.WARNING):
        for i in range(2 * plan_check.MIN_STEPS):
            check.add(1, 1, 0.011 if i % 2 else 0.009)
    assert not caplog.records and 0.9 <= check.ratio() <= 1.1
    assert DecodeCheck("named", predicted_s=None).summary()["measured_over_predicted"] is None


def test_engine_feeds_its_decode_steps_to_the_check_of_the_plan_in_force(tiny_model_dir):
    profile = synthetic(cpu_gflops=50, gpu_gflops=20_000, h2d_gbps=25, cpu_threads=2)
    engine = Engine.load(tiny_model_dir("qwen3"), vram="1GiB", simulate_gpu=True, profile=profile, max_step_tokens=16,
                         max_context=128, max_batch=2)
    engine.generate([[5, 9, 11, 13]], 12)
    summary = engine.plan_check().summary()
    assert summary["steps"] == 11  # the decode steps after the prompt's
    assert summary["predicted_ms"] == engine.plan.tiers[1].predicted_s * 1e3
    assert summary["measured_median_ms"] > 0
    engine.set_vram(engine.executor.need.total // 2)
    engine.generate([[5, 9, 11, 13]], 3)
    assert engine.plan_check().summary()["steps"] == 2  # a new plan: counted afresh
