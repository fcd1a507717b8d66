"""The engine's one generation path: continuous batching, chunked prefill, a plan per token tier."""

import pytest
import torch

from vramshard import Engine
from vramshard.cli.main import main
from vramshard.engine import resolve_budget
from vramshard.errors import BudgetError
from vramshard.plan.planner import Planner
from vramshard.plan.tiers import Tiers
from vramshard.profile.query import synthetic
from vramshard.runtime.executor import Executor
from vramshard.units import auto_vram_budget

from scheduling_helpers import add_staggered, random_prompts

TIERS = (1, 4, 16)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return Engine.load(tiny_model_dir("qwen3"), device="cpu")


@pytest.fixture(scope="module")
def planned(engine):
    """The same model and weights, planned (all on the CPU here) with a placement and thread count per tier."""
    plan = Planner(engine.model, synthetic(cpu_threads=2), None, context=512, tiers=Tiers(TIERS)).plan()
    executor = Executor(engine.model, engine.executor.host, plan.tiered(), max_tokens=TIERS[-1], max_context=512)
    planned = Engine(engine.model, executor, engine.tokenizer, name="planned", max_context=256)
    planned.plan = plan
    return planned


def _prompts(lengths):
    return random_prompts(lengths)


def test_steps_come_from_the_plan_tiers(engine, planned):
    assert planned.step_shape() == (16, TIERS)
    assert engine.step_shape() == (engine.max_step_tokens, None)
    scheduler = planned.scheduler(max_seqs=4, max_context=64)
    assert scheduler.max_step_tokens == 16 and scheduler.chunk_sizes == TIERS


def test_mixed_prompts_arriving_at_different_times_equal_single_generation(engine, planned):
    prompts = _prompts((3, 41, 7, 100, 1, 25, 64, 12))
    new_tokens = [12, 5, 9, 16, 3, 7, 1, 10]
    alone = [engine.generate([p], n)[0] for p, n in zip(prompts, new_tokens)]
    scheduler = planned.scheduler(max_seqs=5, max_context=128)
    requests = add_staggered(scheduler, prompts, new_tokens)
    scheduler.run_until_idle()
    assert [r.output_ids for r in requests] == alone
    history = list(scheduler.history)
    assert any(s.prefill_tokens and s.decode_tokens for s in history)  # prompt chunks beside decode tokens
    assert max(s.tokens for s in history) == 16
    # Cut prompt chunks fill their tier exactly, so most steps run a whole tier's plan.
    full = [s for s in history if s.tokens in TIERS]
    assert len(full) > len(history) // 2
    assert len({planned.executor.plans.index_for(s.tokens) for s in history}) == len(TIERS)  # every plan ran
    assert all(s.forward_s <= s.seconds for s in history)


def test_generate_runs_all_prompts_batched_with_per_prompt_seeds(engine, planned):
    prompts = _prompts((9, 30, 2, 17, 55))
    greedy = planned.generate(prompts, 10)
    assert greedy == [engine.generate([p], 10)[0] for p in prompts]
    stats = planned.last_stats
    assert stats.prompt_tokens == sum(map(len, prompts)) and stats.generated_tokens == 50
    assert stats.prefill_s > 0 and stats.decode_s > 0 and stats.extra["max_running"] > 1
    assert stats.steps < 50  # batched: far fewer steps than one per token per prompt
    assert 0 < stats.extra["scheduling_s"] < stats.prefill_s + stats.decode_s
    sampled = planned.generate(prompts, 8, temperature=0.9, top_k=30, seed=7)
    assert sampled == [engine.generate([p], 8, temperature=0.9, top_k=30, seed=7 + i)[0]
                       for i, p in enumerate(prompts)]


def test_stream_yields_what_generate_returns(engine, planned):
    prompt = _prompts((37,))[0]
    streamed = planned.stream(prompt, 9)
    first = next(streamed)
    assert [first, *streamed] == engine.generate([prompt], 9)[0]
    assert planned.last_stats.generated_tokens == 9 and planned.last_stats.extra["ttft_s"] > 0
    # Closing the stream early is fine, and generation works afterwards.
    partial = planned.stream(prompt, 9)
    assert next(partial) == first
    partial.close()
    assert planned.generate([prompt], 2)[0] == [first, engine.generate([prompt], 2)[0][1]]


def test_logits_and_empty_or_zero_requests(engine):
    prompt = _prompts((20,))[0]
    logits = engine.logits(prompt)
    assert logits.shape == (20, 96) and int(logits[-1].argmax()) == engine.generate([prompt], 1)[0][0]
    assert engine.generate([], 5) == [] and engine.generate([prompt, prompt], 0) == [[], []]


# ---------------------------------------------------------------------------- --vram auto
def test_vram_auto_means_no_gpu_without_cuda(tiny_model_dir, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_budget("auto", None) == (None, "cpu")
    assert resolve_budget(" AUTO ", "cpu") == (None, "cpu")
    assert auto_vram_budget() is None
    engine = Engine.load(tiny_model_dir("llama"), vram="auto")
    assert not engine.executor.uses_gpu and engine.vram_budget is None
    assert main(["run", str(tiny_model_dir("llama")), "--ids", "1,2,3", "-n", "3", "--vram", "auto"]) == 0
    out = capsys.readouterr().out.strip()
    assert [int(t) for t in out.split(",")] == engine.generate([[1, 2, 3]], 3)[0]


def test_vram_auto_is_free_memory_less_a_margin(monkeypatch):
    GiB = 2**30
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * GiB, 16 * GiB))
    margin = int(16 * GiB * 0.05)  # 5% of 16 GiB is more than the 512 MiB floor
    assert auto_vram_budget() == 10 * GiB - margin
    assert resolve_budget("auto", None) == (10 * GiB - margin, "cuda")
    assert resolve_budget("auto", "cpu") == (None, "cpu")
    assert resolve_budget("2GiB", "cpu") == (2 * GiB, "cpu")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (300 * 2**20, 4 * GiB))
    with pytest.raises(BudgetError, match="no free VRAM"):
        resolve_budget("auto", "cuda")


# ---------------------------------------------------------------------------- on the GPU machine
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_planned_mixed_placements_batched_equals_single(tiny_model_dir):
    """A tight budget makes the planner mix placements across tiers; batching must not change greedy tokens."""
    from vramshard.plan.memory import workspace_bytes

    model = Engine.load(tiny_model_dir("qwen3"), device="cpu").model
    profile = synthetic(cpu_gflops=50, gpu_gflops=20_000, h2d_gbps=25, cpu_threads=2)
    probe = Planner(model, profile, None, context=1024, tiers=Tiers(TIERS))
    # Room for the workspace, the stream ring and a fifth of the weights: KV on the CPU, tiers differ.
    budget = workspace_bytes(model, TIERS[-1], 1024) + 2 * probe.slot_bytes + model.nbytes // 5
    gpu = Engine.load(tiny_model_dir("qwen3"), vram=budget, device="cuda", profile=profile,
                      tiers=Tiers(TIERS), max_step_tokens=16, max_context=256, max_batch=4)
    assert gpu.plan is not None and gpu.step_shape() == (16, TIERS)
    print("GPU plan per tier:", {t: p.placement.summary() for t, p in gpu.plan.tiers.items()})
    # Mixed placements across tiers as loaded (the in-situ calibration may re-plan them while the
    # test runs, as in the eleventh GPU session: the tokens must not change either way).
    assert len({p.placement.where for p in gpu.plan.tiers.values()}) > 1
    prompts = _prompts((3, 41, 7, 60, 1, 25))
    alone = [gpu.generate([p], 8)[0] for p in prompts]
    scheduler = gpu.scheduler(max_seqs=4, max_context=128)
    requests = add_staggered(scheduler, prompts, [8] * len(prompts))
    scheduler.run_until_idle()
    assert [r.output_ids for r in requests] == alone
    # Steps are queued early only where their tier's placement runs on the GPU alone.
    queued_tiers = [t for t in TIERS if gpu.executor.queues_without_waiting(t)]
    assert (scheduler.total_overlapped > 0) <= bool(queued_tiers)
    assert gpu.generate(prompts, 8) == alone


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("graphs", [True, False])
def test_gpu_overlapped_steps_equal_reading_every_step(tiny_model_dir, graphs):
    """All weights in VRAM (decode from CUDA graphs, or eager): steps queued on the unread tokens of
    the step before give the tokens of steps read one by one, a sequence ending on EOS included."""
    gpu = Engine.load(tiny_model_dir("qwen3"), device="cuda", max_context=256, max_batch=4, decode_graphs=graphs)
    assert gpu.executor.queues_without_waiting(1)  # every sub-layer resident: GPU work alone
    prompts = _prompts((3, 41, 7, 60, 1, 25))
    plain = [gpu.generate([p], 12)[0] for p in prompts]
    eos = plain[1][5]
    outputs = {}
    for overlap in (False, None):
        scheduler = gpu.scheduler(max_seqs=4, max_context=128, overlap=overlap)
        scheduler.eos_ids = frozenset({eos})
        requests = add_staggered(scheduler, prompts, [12] * len(prompts))
        scheduler.run_until_idle()
        outputs[overlap] = [r.output_ids for r in requests]
        assert (scheduler.total_overlapped > 0) == (overlap is None)
        assert scheduler.blocks.used_blocks == 0 and scheduler.kv_reserved == 0
    assert outputs[None] == outputs[False] == [out[: out.index(eos) + 1] if eos in out else out for out in plain]


def test_a_step_says_the_longest_context_it_attends_over(engine):
    """Each step's context is its sequences' cached tokens plus its new ones, the longest of them:
    a lone sequence's prompt, then one more with each decode step."""
    prompt = _prompts((13,))[0]
    scheduler = engine.scheduler(max_seqs=1, max_context=64)
    scheduler.add(prompt, max_new_tokens=5)
    scheduler.run_until_idle()
    history = list(scheduler.history)
    assert [s.context for s in history] == [13, 14, 15, 16, 17]
