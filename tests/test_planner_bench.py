"""benchmarks/planner_bench.py's closed calibration (``--calibrate``), with the executor's
measurement faked: the fit, the re-plan and its prediction are the real ones."""

import types
from pathlib import Path

import pytest

from benchmarks import planner_bench
from vramshard.plan import calibrate
from vramshard.plan.planner import Planner
from vramshard.plan.tiers import Tiers
from vramshard.profile import load
from vramshard.shapes import shape_model

H200 = Path(__file__).resolve().parent.parent / "docs" / "profiles" / "h200-queued.json"
GiB = 2**30


def test_a_slow_split_plan_is_fitted_re_planned_and_the_new_choice_measured(monkeypatch):
    model, profile, tiers = shape_model("nemo-8b"), load(H200, check_fingerprint=False), Tiers((1,))
    plan = Planner(model, profile, 2 * GiB, context=4096, tiers=tiers).plan()
    first = plan.tiers[1]
    assert first.placement.split_names()
    run = []
    monkeypatch.setattr(planner_bench, "Executor", lambda model, host, tiered, **kw: run.append(tiered) or object())
    monkeypatch.setattr(planner_bench, "step_and_cpu_seconds", lambda executor, tier, ctx, seq_ctx: (0.150, 0.1))
    monkeypatch.setattr(planner_bench.torch.cuda, "empty_cache", lambda: None)
    measured = {f: s * 1e3 for f, s in first.candidates.items()}
    measured[first.family] *= 1.6  # the chosen plan ran 1.6x its prediction
    out = planner_bench.calibrated_cell(model, types.SimpleNamespace(for_placement=lambda tiered: None), profile, plan,
                                        1, 2 * GiB, tiers, {"measured_ms": measured},
                                        types.SimpleNamespace(ctx=4096, seq_ctx=1024))
    assert out["fitted"] == "split_part_scale" and out["value"] > 1
    (tiered,) = run  # a placement not measured before: run once
    assert tiered.placements[0].where != first.placement.where
    assert out["measured_ms"] == 150.0 and out["error_pct"] == pytest.approx((out["predicted_ms"] - 150) / 1.5)
    assert out["is_fastest"] == (150.0 <= min(measured.values()) * 1.02)
    assert out["speedup_over_first_choice"] == pytest.approx(measured[first.family] / 150)
    assert out["host_compute_ms"] == pytest.approx(100.0)
    # With the executor's timing of the chosen plan's CPU work, the fit is the engine's: the CPU
    # factor at its rows from that timing, then the dispatch from the rest of the step.
    cpu_ms = 1.4 * calibrate.cpu_seconds(model, profile, plan, 1) * 1e3
    timed = planner_bench.calibrated_cell(model, types.SimpleNamespace(for_placement=lambda tiered: None), profile,
                                          plan, 1, 2 * GiB, tiers,
                                          {"measured_ms": measured, "host_compute_ms": {first.family: cpu_ms}},
                                          types.SimpleNamespace(ctx=4096, seq_ctx=1024))
    assert timed["fitted"].startswith("cpu_rows") and 1.3 < timed["value"]["cpu_rows"][1] < 1.5


TINY_ARGS = types.SimpleNamespace(tiers="1,16", budgets="0.127,1", ctx=256, seq_ctx=64, measure_within=3.0,
                                  calibrate=False)
TINY_BANDWIDTH = {"h2d": 55e9, "cpu_read": 100e9, "shared_total": 140e9}


@pytest.fixture
def simulated_gpu(monkeypatch):
    """The benchmark's executors simulate the GPU, and its host weights are not pinned (no CUDA here)."""
    import functools

    monkeypatch.setattr(planner_bench, "Executor", functools.partial(planner_bench.Executor, simulate_gpu=True))
    real_pack = planner_bench.pack_model
    monkeypatch.setattr(planner_bench, "pack_model", lambda *a, pin=True, **kw: real_pack(*a, pin=False, **kw))


def test_the_grid_runs_end_to_end_on_a_tiny_shape_with_a_simulated_gpu(simulated_gpu):
    """The benchmark's whole per-model grid (plan, each family within reach, the baseline, the
    bound) on a tiny shape, the executor simulating the GPU: a GPU session's call must not be the
    first to find the benchmark broken (it last ran in the seventh GPU session)."""
    seen = []  # the cells done, each time one is
    out = planner_bench.run_model("tiny-llama", TINY_ARGS, load(H200, check_fingerprint=False), TINY_BANDWIDTH,
                                  on_cell=lambda entry: seen.append(len(entry["cells"])))
    cells = out["cells"]
    assert seen == [1, 2, 3, 4] and out["skipped"] == []
    assert [(c["budget_gib"], c["tier"]) for c in cells] == [(0.127, 1), (0.127, 16), (1.0, 1), (1.0, 16)]
    for cell in cells:
        assert cell["chosen"] in cell["measured_ms"] and cell["measured_ms"][cell["chosen"]] > 0
        assert "error_pct" in cell and isinstance(cell["chosen_is_fastest"], bool)
    for cell in (c for c in cells if c["tier"] == 1):
        assert cell["baseline"].startswith("layers:") and cell["baseline_tok_s"] > 0
        assert cell["tok_s"] > 0 and cell["bound_tok_s"] > 0


def test_no_cell_starts_after_the_deadline_and_those_left_out_are_named(simulated_gpu):
    import time

    out = planner_bench.run_model("tiny-llama", TINY_ARGS, load(H200, check_fingerprint=False), TINY_BANDWIDTH,
                                  deadline=time.perf_counter() - 1)
    assert out["cells"] == []
    assert out["skipped"] == ["0.127 GiB tier 1", "0.127 GiB tier 16", "1 GiB tier 1", "1 GiB tier 16"]
