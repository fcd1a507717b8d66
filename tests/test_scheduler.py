"""Continuous batching on the CPU: the scheduler gives every request exactly what it would get alone."""

import asyncio

import pytest

from vramshard.errors import InvalidInputError
from vramshard.runtime.engine_loop import EngineLoop
from vramshard.runtime.request import RequestStatus
from vramshard.runtime.sampler import SamplingParams

from scheduling_helpers import add_staggered, random_prompts

LENGTHS = (3, 41, 7, 100, 1, 25, 64, 12)


@pytest.fixture(scope="module")
def engine(cpu_qwen3):
    return cpu_qwen3


@pytest.fixture(scope="module")
def demo(cpu_demo):
    return cpu_demo


def _prompts(lengths=LENGTHS):
    return random_prompts(lengths)


@pytest.mark.parametrize("max_step_tokens,chunk_sizes,max_seqs", [(32, (4, 16), 3), (2048, None, 8), (7, (1, 4), 5)])
def test_interleaved_arrivals_equal_single_generation(engine, max_step_tokens, chunk_sizes, max_seqs):
    prompts = _prompts()
    new_tokens = [12, 5, 9, 16, 3, 7, 1, 10]
    alone = [engine.generate([p], n)[0] for p, n in zip(prompts, new_tokens)]
    scheduler = engine.scheduler(max_seqs=max_seqs, max_context=128, max_step_tokens=max_step_tokens,
                                 chunk_sizes=chunk_sizes)
    requests = add_staggered(scheduler, prompts, new_tokens)
    scheduler.run_until_idle()
    assert [r.output_ids for r in requests] == alone
    assert all(r.finish_reason == "length" and r.is_finished for r in requests)
    assert sorted(scheduler.free_slots) == list(range(max_seqs)) and scheduler.kv_reserved == 0
    # Steps really mixed sequences and respected the token budget.
    assert max(s.sequences for s in scheduler.history) > 1
    assert max(s.tokens for s in scheduler.history) <= max_step_tokens
    assert any(s.prefill_tokens and s.decode_tokens for s in scheduler.history)


def test_outputs_stream_through_callbacks(engine):
    prompt = _prompts((9,))[0]
    seen = []
    scheduler = engine.scheduler(max_seqs=2, max_context=64)
    request = scheduler.add(prompt, max_new_tokens=6, on_output=seen.append)
    scheduler.run_until_idle()
    assert [t for out in seen for t in out.token_ids] == request.output_ids == engine.generate([prompt], 6)[0]
    assert [out.finished for out in seen] == [False] * 5 + [True] and seen[-1].finish_reason == "length"


def test_requests_wait_when_slots_are_full(engine):
    prompts = _prompts((5, 6, 7, 8))
    scheduler = engine.scheduler(max_seqs=2, max_context=64)
    requests = [scheduler.add(p, max_new_tokens=4) for p in prompts]
    scheduler.step()
    assert [r.status for r in requests] == [RequestStatus.RUNNING] * 2 + [RequestStatus.WAITING] * 2
    assert scheduler.queue_length == 2 and scheduler.history[-1].running == 2
    scheduler.run_until_idle()
    assert [r.output_ids for r in requests] == [engine.generate([p], 4)[0] for p in prompts]


def test_requests_wait_when_the_kv_token_budget_is_spent(engine):
    prompts = _prompts((20, 20))
    scheduler = engine.scheduler(max_seqs=4, max_context=64, kv_tokens=40)
    first, second = (scheduler.add(p, max_new_tokens=10) for p in prompts)
    scheduler.step()
    assert first.status is RequestStatus.RUNNING and second.status is RequestStatus.WAITING  # 30 + 30 > 40
    while first.status is RequestStatus.RUNNING:
        scheduler.step()
    scheduler.step()
    assert second.status is not RequestStatus.WAITING
    scheduler.run_until_idle()
    assert second.output_ids == engine.generate([prompts[1]], 10)[0]
    with pytest.raises(InvalidInputError, match="context of 40"):
        scheduler.add(_prompts((35,))[0], max_new_tokens=10)


def test_cancel_frees_the_slot_at_the_next_step(engine):
    long_prompt, short_prompt = _prompts((30, 6))
    outputs = []
    scheduler = engine.scheduler(max_seqs=1, max_context=100)
    doomed = scheduler.add(long_prompt, max_new_tokens=50, on_output=outputs.append)
    waiting = scheduler.add(short_prompt, max_new_tokens=5)
    for _ in range(3):
        scheduler.step()
    assert doomed.slot == 0 and waiting.status is RequestStatus.WAITING
    doomed.cancel()
    scheduler.step()
    assert doomed.finish_reason == "cancelled" and doomed.slot is None and outputs[-1].finished
    assert waiting.status is RequestStatus.RUNNING and waiting.slot == 0
    scheduler.run_until_idle()
    assert waiting.output_ids == engine.generate([short_prompt], 5)[0]
    # A request cancelled while still waiting never runs.
    queued = scheduler.add(short_prompt, max_new_tokens=5)
    queued.cancel()
    assert scheduler.step() is None and queued.finish_reason == "cancelled" and not queued.output_ids


def test_stop_strings_cut_text_and_tokens_like_generate(demo):
    prompt = demo.tokenizer.encode("The plan is printed as a table")
    full_ids = demo.generate([prompt], 24, temperature=0.9, seed=5)[0]
    full = demo.tokenizer.decode(full_ids)
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip()
    scheduler = demo.scheduler(max_seqs=4, max_context=256)
    other = scheduler.add(demo.tokenizer.encode("a different prompt"), SamplingParams(0.9, seed=1), 24)
    request = scheduler.add(prompt, SamplingParams(0.9, seed=5), 24, stop=["never-there", stop])
    scheduler.run_until_idle()
    assert request.finish_reason == "stop" and request.stop_hit == stop
    assert request.text == full[: full.index(stop)]
    assert request.output_ids == demo.generate([prompt], 24, temperature=0.9, seed=5, stop=[stop])[0]
    assert other.text == demo.tokenizer.decode(other.output_ids)  # no stop: all of it


def test_seeded_sampling_is_reproducible_and_independent_of_batching(engine):
    prompts = _prompts((10, 30, 4, 17))
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=42)
    alone = engine.scheduler(max_seqs=1, max_context=64)
    single = alone.add(prompts[0], params, 12)
    alone.run_until_idle()
    busy = engine.scheduler(max_seqs=4, max_context=64, max_step_tokens=16, chunk_sizes=(4,))
    crowd = [busy.add(p, SamplingParams(1.0, 20, 0.9, seed=i), 12) for i, p in enumerate(prompts[1:])]
    busy.step()
    batched = busy.add(prompts[0], params, 12)
    busy.run_until_idle()
    assert batched.output_ids == single.output_ids
    assert single.output_ids == engine.generate([prompts[0]], 12, temperature=1.0, top_k=20, top_p=0.9, seed=42)[0]
    assert len({tuple(r.output_ids) for r in crowd}) == 3


def test_bad_requests_are_refused_up_front(engine):
    scheduler = engine.scheduler(max_seqs=1, max_context=32)
    with pytest.raises(InvalidInputError, match="context of 32"):
        scheduler.add(list(range(30)), max_new_tokens=3)
    with pytest.raises(InvalidInputError, match="out of range"):
        scheduler.add([1, 2, 96])
    with pytest.raises(InvalidInputError, match="at least one token"):
        scheduler.add([])
    with pytest.raises(InvalidInputError, match="tokenizer"):
        scheduler.add([1, 2], max_new_tokens=3, stop=["x"])
    assert not scheduler.has_work


def test_engine_loop_serves_threads_and_asyncio(engine):
    prompts = _prompts((8, 20, 3))
    expected = [engine.generate([p], 7)[0] for p in prompts]
    loop = EngineLoop(engine.scheduler(max_seqs=2, max_context=64))
    try:
        handles = [loop.submit(p, max_new_tokens=7) for p in prompts]
        assert [[t for out in h for t in out.token_ids] for h in handles] == expected

        async def consume():
            handles = [loop.submit(p, max_new_tokens=7) for p in prompts]
            results = []
            for handle in handles:
                results.append([t for out in [o async for o in handle] for t in out.token_ids])
            doomed = loop.submit(prompts[1], max_new_tokens=40)
            async for out in doomed:
                loop.cancel(doomed)
                if out.finished:
                    break
            return results, doomed.request

        results, doomed = asyncio.run(consume())
        assert results == expected
        assert doomed.finish_reason == "cancelled" and len(doomed.output_ids) < 40
        stats = loop.stats()
        assert stats["engine_alive"] and stats["running"] == 0 and stats["steps"] > 0
        assert stats["free_slots"] == 2
    finally:
        loop.close()
    assert not loop.alive
