"""benchmarks/paired_decode.py's rounds, on two tiny CPU engines (the benchmark itself needs a GPU)."""

import time

import pytest

from benchmarks.common import decode_bound_tok_s
from benchmarks.paired_decode import Decoding, paired_rounds, summary
from vramshard import Engine
from vramshard.cli.bench import BenchSettings


def slowed(decoding: Decoding, seconds: float) -> Decoding:
    """Each of its steps' forward ``seconds`` longer."""
    executor = decoding.engine.executor
    forward_logits = executor.forward_logits

    def slow_forward(*args, **kwargs):
        time.sleep(seconds)
        return forward_logits(*args, **kwargs)

    executor.forward_logits = slow_forward
    return decoding


def test_rounds_alternate_the_engines_and_time_each_ones_own_steps(tiny_model_dir):
    settings = BenchSettings(pp=8, tg=40, batch_sizes=(1,), batch_prompt=4, batch_gen=4)
    fast = Decoding("vramshard", Engine.load(tiny_model_dir("qwen3"), device="cpu"), settings, 40)
    slow = slowed(Decoding("layers:max", Engine.load(tiny_model_dir("qwen3"), device="cpu"), settings, 40), 0.05)
    reads = iter([100.0, 90.0, 110.0, 95.0])
    rounds = paired_rounds(fast, slow, 4, 5, read_gb_s=lambda: next(reads))
    assert [r["order"] for r in rounds] == [["vramshard", "layers:max"], ["layers:max", "vramshard"]] * 2
    # Each engine's own steps: the slowed one's all sleep 50 ms, the other's none (a tiny model's step takes a few ms;
    # a difference of the two medians failed twice beside another test run on this 2-core machine).
    assert all(r["baseline_step_ms"] >= 50 > r["planned_step_ms"] for r in rounds)
    assert all(r["speedup"] > 1 for r in rounds) and [r["host_read_gb_s"] for r in rounds] == [100, 90, 110, 95]
    assert len(fast.scheduler.history) >= 20 and len(slow.scheduler.history) >= 20
    bandwidth = {"h2d": 50.0, "cpu_read": 100.0, "shared_total": 120.0}
    out = summary(rounds, 10**9, bandwidth)
    assert out["rounds_planned_ahead"] == 4 and out["speedup_min"] > 1
    assert out["decode_bound_tok_s_at_median_read"] == pytest.approx(decode_bound_tok_s(10**9, bandwidth, 97.5)[0])
    assert out["host_read_gb_s_range"] == [90, 110]
    with pytest.raises(RuntimeError, match="ended early"):
        fast.segment(50)
    fast.close(), slow.close()
    assert not fast.scheduler.has_work and not slow.scheduler.has_work


def test_decodes_bound_is_the_smaller_of_the_two_readers_at_once_and_the_shared_cap():
    bandwidth = {"h2d": 50.0, "cpu_read": 100.0, "shared_total": 120.0}
    assert decode_bound_tok_s(10**9, bandwidth) == (pytest.approx(120.0), pytest.approx(150.0))
    # at half the read: the CPU's share and the shared cap both halve
    assert decode_bound_tok_s(10**9, bandwidth, 50.0) == (pytest.approx(60.0), pytest.approx(100.0))
    assert decode_bound_tok_s(10**9, {"h2d": 50.0, "cpu_read": 100.0}) == (pytest.approx(150.0),) * 2


def test_batched_rounds_time_steps_of_the_whole_batch(tiny_model_dir):
    """With a batch, each engine's steps decode all its requests (a step that does not is refused), and the
    summary gives each engine's tokens a second; decode's bound (one sequence's) is left out."""
    batch = 3
    settings = BenchSettings(pp=6, tg=30, batch_sizes=(batch,), batch_prompt=6, batch_gen=30)
    fast = Decoding("vramshard", Engine.load(tiny_model_dir("qwen3"), device="cpu"), settings, 30, 6, batch)
    slow = slowed(Decoding("layers:max", Engine.load(tiny_model_dir("qwen3"), device="cpu"), settings, 30, 6, batch),
                  0.02)
    assert len(fast.requests) == batch and all(r.first_token_s is not None for r in fast.requests)
    rounds = paired_rounds(fast, slow, 2, 4, read_gb_s=lambda: 100.0)
    assert all(step.decode_tokens == batch for step in list(fast.scheduler.history)[-8:])
    out = summary(rounds, 10**9, {"h2d": 50.0, "cpu_read": 100.0}, batch)
    assert out["batch"] == batch and out["speedup_min"] > 1
    assert out["planned_tok_s"] == pytest.approx(batch * 1e3 / out["planned_step_ms_median"])
    assert out["baseline_tok_s"] < out["planned_tok_s"]
    assert "decode_bound_tok_s_at_median_read" not in out and out["host_read_gb_s_range"] == [100.0, 100.0]
    fast.requests[0].cancel()  # (a step of two of the three: not the batch's)
    with pytest.raises(RuntimeError, match="decoded 2 of its 3"):
        fast.segment(2)
    fast.close(), slow.close()
