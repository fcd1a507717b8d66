"""Overlapped steps: the scheduler queues step k+1 on step k's unread greedy tokens.

On the CPU nothing runs while the host prepares the next step, so ``overlap=True`` here tests
the mechanism (which rows are fed from the unread tokens, which are dropped, when it must not
queue early), not the speed; the GPU tests run it where it is the default.
"""

import pytest
import torch

from vramshard.runtime.request import RequestStatus
from vramshard.runtime.sampler import SamplingParams
from vramshard.runtime.scheduler import Scheduler
from vramshard.runtime.step_logits import StepLogits, TokenIds

from scheduling_helpers import add_staggered, random_prompts

LENGTHS = (3, 41, 7, 100, 1, 25, 64, 12)
NEW = (12, 5, 9, 16, 3, 7, 1, 10)


@pytest.fixture(scope="module")
def engine(cpu_qwen3):
    return cpu_qwen3


def _run(scheduler, prompts, new_tokens, params=None):
    """Requests arriving beside queued steps (see add_staggered), run to the end."""
    requests = add_staggered(scheduler, prompts, new_tokens, params)
    scheduler.run_until_idle()
    return requests


def _scheduler(engine, overlap, **kw):
    options = dict(max_seqs=5, max_context=128, max_step_tokens=32, chunk_sizes=(4, 16))
    options.update(kw)
    return Scheduler(engine.executor, vocab_size=engine.args.vocab_size, overlap=overlap, **options)


def _drained(scheduler):
    return (sorted(scheduler.free_slots) == list(range(scheduler.max_seqs)) and scheduler.kv_reserved == 0
            and scheduler.blocks.used_blocks == 0 and not scheduler.has_work)


@pytest.mark.parametrize("max_step_tokens,chunk_sizes,max_seqs", [(32, (4, 16), 3), (2048, None, 8), (7, (1, 4), 5)])
def test_overlapped_steps_give_the_tokens_of_single_generation(engine, max_step_tokens, chunk_sizes, max_seqs):
    prompts = random_prompts(LENGTHS)
    alone = [engine.generate([p], n)[0] for p, n in zip(prompts, NEW)]
    scheduler = _scheduler(engine, True, max_step_tokens=max_step_tokens, chunk_sizes=chunk_sizes, max_seqs=max_seqs)
    requests = _run(scheduler, prompts, NEW)
    assert [r.output_ids for r in requests] == alone
    assert all(r.finish_reason == "length" for r in requests) and _drained(scheduler)
    assert scheduler.total_overlapped > len(scheduler.history) // 2  # most steps were queued early
    assert any(s.prefill_tokens and s.decode_tokens for s in scheduler.history)  # fed rows beside prompt chunks
    assert sum(s.sampled for s in scheduler.history) == sum(NEW)  # no token counted twice or lost
    # No row is queued for a request whose last token is on its way: each caches its prompt and
    # all but its last token, nothing more.
    assert sum(s.tokens for s in scheduler.history) == sum(len(p) + n - 1 for p, n in zip(prompts, NEW))


def test_overlap_is_off_on_the_cpu_by_default_and_when_asked(engine):
    prompts = random_prompts((9, 30, 2))
    for overlap in (None, False):
        scheduler = _scheduler(engine, overlap)
        requests = _run(scheduler, prompts, (6, 6, 6))
        assert scheduler.total_overlapped == 0
        assert [r.output_ids for r in requests] == [engine.generate([p], 6)[0] for p in prompts]


def test_a_sequence_ending_on_eos_drops_the_row_queued_after_it(engine):
    prompts = random_prompts((5, 17, 9, 33))
    plain = [engine.generate([p], 20)[0] for p in prompts]
    eos = plain[1][6]  # ends the second prompt at its 7th token (and maybe others earlier)
    expected = [out[: out.index(eos) + 1] if eos in out else out for out in plain]
    for overlap in (False, True):
        scheduler = _scheduler(engine, overlap, eos_ids=[eos])
        requests = _run(scheduler, prompts, (20,) * 4)
        assert [r.output_ids for r in requests] == expected
        assert [r.finish_reason for r in requests] == ["stop" if eos in out else "length" for out in plain]
        assert _drained(scheduler)
        assert sum(s.sampled for s in scheduler.history) == sum(map(len, expected))


def test_stop_strings_with_overlap(cpu_demo):
    demo = cpu_demo
    prompt = demo.tokenizer.encode("The plan is printed as a table")
    full_ids = demo.generate([prompt], 24)[0]
    full = demo.tokenizer.decode(full_ids)
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip()
    scheduler = Scheduler(demo.executor, max_seqs=4, max_context=256, tokenizer=demo.tokenizer, overlap=True)
    other = scheduler.add(demo.tokenizer.encode("a different prompt"), max_new_tokens=24)
    request = scheduler.add(prompt, max_new_tokens=24, stop=["never-there", stop])
    scheduler.run_until_idle()
    assert request.finish_reason == "stop" and request.text == full[: full.index(stop)]
    assert request.output_ids == demo.generate([prompt], 24, stop=[stop])[0]
    assert other.output_ids == demo.generate([demo.tokenizer.encode("a different prompt")], 24)[0]
    assert scheduler.total_overlapped > 0 and _drained(scheduler)


def test_samplers_that_read_logits_are_never_fed_unread_tokens(engine):
    """A sampling request in the batch: the steps it samples in are read before the next is queued."""
    prompts = random_prompts((9, 30, 2, 17))
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=20, seed=3), SamplingParams(),
              SamplingParams(repetition_penalty=1.3)]
    scheduler = _scheduler(engine, True)
    requests = _run(scheduler, prompts, (8, 8, 8, 8), params)
    expected = [engine.generate([p], 8, temperature=s.temperature, top_k=s.top_k, seed=s.seed,
                                repetition_penalty=s.repetition_penalty)[0] for p, s in zip(prompts, params)]
    assert [r.output_ids for r in requests] == expected and _drained(scheduler)


def test_cancel_while_a_step_is_queued(engine):
    long_prompt, short_prompt = random_prompts((30, 6))
    scheduler = _scheduler(engine, True, max_seqs=1)
    doomed = scheduler.add(long_prompt, max_new_tokens=50)
    waiting = scheduler.add(short_prompt, max_new_tokens=5)
    for _ in range(4):
        scheduler.step()
    assert scheduler._pending is not None  # a decode step of `doomed` is queued
    doomed.cancel()
    scheduler.step()
    assert doomed.finish_reason == "cancelled" and doomed.slot is None
    scheduler.run_until_idle()
    assert waiting.status is RequestStatus.FINISHED
    assert waiting.output_ids == engine.generate([short_prompt], 5)[0] and _drained(scheduler)


def test_token_ids_feed_rows_and_host_ids():
    logits = torch.tensor([[0.0, 3.0, 3.0], [5.0, 1.0, 0.0], [0.0, 0.0, 9.0]])
    step = StepLogits(logits)
    tokens = step.argmax()
    assert tokens.tolist() == [1, 0, 2]  # the first maximum on a tie, as torch.argmax
    assert tokens.feed([0, 1, 2], [0, 0, 0]) is tokens.device_ids  # every row, in order: no copy
    assert tokens.feed([2, 0], [0, 0]).tolist() == [2, 1]
    assert tokens.feed([-1, 1, -1, -1], [7, 0, 8, 9]).tolist() == [7, 0, 8, 9]
    assert tokens.feed([-1, 2, -1], [7, 0, 8]).tolist() == [7, 2, 8]
    assert torch.equal(step.rows([2, 0]), logits[[2, 0]])
    assert torch.equal(step.rows([0, 1, 2]), logits)
    assert isinstance(tokens, TokenIds) and not tokens.on_gpu


def test_a_first_token_is_read_before_the_next_step_is_queued(engine):
    """Time to first token is not held back by queueing (and maybe capturing) the next step."""
    scheduler = _scheduler(engine, True)
    request = scheduler.add(random_prompts((20,))[0], max_new_tokens=6)
    scheduler.step()  # the prompt: its first token is read at once
    assert len(request.output_ids) == 1 and scheduler._pending is None
    scheduler.step()  # a decode step: the one after it is queued before it is read
    assert len(request.output_ids) == 2 and scheduler._pending is not None
    scheduler.run_until_idle()
    assert request.output_ids == engine.generate([random_prompts((20,))[0]], 6)[0]


def test_only_steps_of_gpu_work_alone_are_queued_early(engine):
    """The executor tells which tiers queue GPU work only: a CPU engine's never do."""
    assert not engine.executor.queues_without_waiting(1)
