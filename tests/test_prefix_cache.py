"""Prefix caching: full KV blocks filed under their token ids and taken by later prompts that start
with them (a chat's next turn, a shared system prompt), with the same tokens as computing them."""

import pytest
import torch

from vramshard.runtime.kv_cache import BlockAllocator, prefix_keys
from vramshard.runtime.request import MultimodalInput, Request

from scheduling_helpers import add_staggered, random_prompts

BLOCK = 16  # the scheduler's block size (kv_cache.DEFAULT_BLOCK_SIZE)


@pytest.fixture(scope="module")
def engine(cpu_qwen3):
    return cpu_qwen3


# ---------------------------------------------------------------------------- the allocator
def test_equal_keys_mean_equal_prefixes():
    a = prefix_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)  # two full blocks; the ninth token is no block
    assert len(a) == 2 and a == prefix_keys([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = prefix_keys([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a[0] != b[0] and a[1] != b[1]  # the second block's ids are equal, what came before is not
    assert prefix_keys([1, 2, 3], 4) == []


def _pool_with_a_filed(num_blocks: int) -> tuple[BlockAllocator, list[tuple]]:
    """A pool of 4-position blocks where sequence "a" holds 12 positions, all filed; and their keys."""
    blocks = BlockAllocator(num_blocks=num_blocks, block_size=4)
    keys = prefix_keys(list(range(12)), 4)
    blocks.admit("a", 12)
    blocks.grow("a", 12)
    blocks.register("a", keys)
    return blocks, keys


def test_blocks_of_a_prefix_are_shared_then_cached_then_give_way_least_recent_first():
    blocks, keys = _pool_with_a_filed(num_blocks=6)
    assert blocks.cached_prefix(keys) == blocks.table("a") == [0, 1, 2] and blocks.cached_blocks == 3
    assert blocks.cached_prefix(prefix_keys([0, 1, 2, 3, 9, 9, 9, 9], 4)) == [0]  # the first block only
    blocks.admit("b", 9, blocks.cached_prefix(keys)[:2])
    assert blocks.table("b") == [0, 1] and blocks.grow("b", 9) == [0, 1, 3]  # its own block for position 8
    blocks.release("a")  # b holds 0 and 1 still; 2 is cached and held by nobody
    assert blocks.free_blocks == 3 and blocks.reserved_blocks == 3 and blocks.cached_prefix(keys) == [0, 1, 2]
    blocks.release("b")  # 3 was never filed: free; 0, 1 cached
    assert blocks.free_blocks == 6 and blocks.used_blocks == 0 and blocks.cached_blocks == 3
    blocks.admit("c", 24)
    table = blocks.grow("c", 24)  # the free blocks first, then the cached ones, least recently released first
    assert table == [3, 4, 5, 2, 0, 1]
    assert blocks.cached_blocks == 0 and blocks.cached_prefix(keys) == []


def test_a_prefix_must_be_cached_blocks_within_the_reservation():
    blocks = BlockAllocator(num_blocks=4, block_size=4)
    blocks.admit("a", 8)
    blocks.grow("a", 8)
    with pytest.raises(ValueError, match="not all cached"):
        blocks.admit("b", 8, [0])  # held by a, never filed
    blocks.register("a", prefix_keys(list(range(8)), 4))
    with pytest.raises(ValueError, match="not all cached"):
        blocks.admit("b", 4, [0, 1])  # more blocks than 4 positions reserve
    blocks.forget_cached()
    assert blocks.cached_blocks == 0 and blocks.table("a") == [0, 1]


def test_a_full_pool_of_reservations_still_grows_through_cached_blocks():
    """Held blocks never exceed the reservations, so a growing sequence always finds a free or a
    cached block: sharing saves compute, never the guarantee that a sequence is not stranded."""
    blocks = BlockAllocator(num_blocks=4, block_size=2)
    for name, tokens in (("a", [1, 2, 3, 4]), ("b", [5, 6, 7, 8])):
        blocks.admit(name, 4)
        blocks.grow(name, 4)
        blocks.register(name, prefix_keys(tokens, 2))
        blocks.release(name)
    assert blocks.free_blocks == 4 and blocks.cached_blocks == 4
    blocks.admit("c", 4, blocks.cached_prefix(prefix_keys([1, 2, 3, 4], 2)))
    blocks.admit("d", 4)
    assert not blocks.can_admit(1)
    assert len(blocks.grow("d", 4)) == 2 and blocks.cached_prefix(prefix_keys([1, 2], 2)) == blocks.table("c")[:1]


def test_sequences_sharing_a_prefix_are_charged_for_it_once():
    blocks, keys = _pool_with_a_filed(num_blocks=5)
    shared = blocks.cached_prefix(keys[:2])
    assert blocks.charge(12, shared) == 1 and blocks.unreserved_blocks == 2
    blocks.admit("b", 12, shared)
    blocks.admit("c", 12, shared)  # reservations of 9 blocks in a pool of 5
    assert blocks.committed_blocks == 5 and not blocks.can_admit(4)
    blocks.release("a")  # its first two blocks stay held by b and c, its third is cached
    assert blocks.committed_blocks == 4 and blocks.can_admit(4) and not blocks.can_admit(8)
    assert blocks.charge(4, [2]) == 1  # a cached block nobody holds is charged to the sequence taking it
    assert blocks.grow("b", 12)[:2] == blocks.grow("c", 12)[:2] == shared
    blocks.release("b"), blocks.release("c")
    assert blocks.committed_blocks == 0 and blocks.free_blocks == 5


def test_growth_never_fails_however_sequences_share_release_and_take_cached_blocks():
    """Random admissions (prompts from a few shared prefixes), growth, filing and releases: every
    admitted sequence can grow to its reservation, and what the pool promised never exceeds it."""
    import random

    rng = random.Random(0)
    blocks = BlockAllocator(num_blocks=12, block_size=2)
    stems = [[rng.randrange(5) for _ in range(8)] for _ in range(3)]
    running: dict[int, tuple[list[int], int]] = {}  # seq -> (its tokens, reserved positions)
    shared_admissions = 0
    for seq in range(600):
        if running and rng.random() < 0.4:  # a running sequence ends, its written blocks filed
            done = rng.choice(list(running))
            tokens, _ = running.pop(done)
            written = len(blocks.table(done)) * 2
            blocks.register(done, prefix_keys(tokens[:written], 2))
            blocks.release(done)
        tokens = rng.choice(stems)[: rng.randrange(2, 9)] + [rng.randrange(5) for _ in range(rng.randrange(4))]
        reserve = len(tokens) + rng.randrange(1, 6)
        prefix = blocks.cached_prefix(prefix_keys(tokens, 2)[: (len(tokens) - 1) // 2])
        if blocks.can_admit(reserve, prefix):
            shared_admissions += any(block in blocks._holders for block in prefix)
            blocks.admit(seq, reserve, prefix)
            running[seq] = (tokens, reserve)
        for other, (other_tokens, other_reserve) in running.items():  # each grows some (never fails)
            grown = min(other_reserve, len(blocks.table(other)) * 2 + rng.randrange(0, 4))
            blocks.grow(other, grown)
            blocks.register(other, prefix_keys(other_tokens[: min(grown, len(other_tokens))], 2))
        assert blocks.committed_blocks <= blocks.num_blocks
        assert blocks.free_blocks == blocks.num_blocks - len({b for s in running for b in blocks.table(s)})
    for seq, (_, reserve) in running.items():
        blocks.grow(seq, reserve)
    assert shared_admissions > 20


# ---------------------------------------------------------------------------- the scheduler
def test_a_chats_next_turn_reads_only_what_it_does_not_share_with_the_last(engine):
    first = random_prompts([45], seed=3)[0]
    conversation = engine.scheduler(max_seqs=1, max_context=160, prefix_cache=True)
    answer = list(engine.stream(first, 12, scheduler=conversation))
    assert answer == engine.generate([first], 12)[0]
    computed = conversation.total_prompt_tokens
    second = first + answer + [5, 6, 7]
    again = list(engine.stream(second, 12, scheduler=conversation))
    assert again == engine.generate([second], 12)[0]  # a scheduler of its own: nothing cached
    fed = len(first) + len(answer) - 1  # the last answer token was sampled, never read
    cached = min(fed // BLOCK, (len(second) - 1) // BLOCK) * BLOCK
    assert cached == 48
    assert conversation.total_cached_prompt_tokens == cached
    assert conversation.total_prompt_tokens - computed == len(second) - cached
    assert engine.last_stats.extra["cached_prompt_tokens"] == 0  # (the generate call's)


@pytest.mark.parametrize("kv_tokens", [None, 96], ids=["room", "cached-blocks-give-way"])
def test_prompts_sharing_a_prefix_give_the_tokens_of_computing_it(engine, kv_tokens):
    """A system prompt shared by prompts arriving while others read and decode; with a small pool the
    cached blocks give way to growing sequences. Every output equals its generation alone."""
    system = random_prompts([37], seed=5)[0]
    tails = random_prompts([3, 20, 9, 1, 30, 14], seed=6)
    prompts = [system + tail for tail in tails] + [system[:20]]
    new_tokens = [6, 4, 9, 3, 5, 7, 2]
    alone = [engine.generate([p], n)[0] for p, n in zip(prompts, new_tokens)]
    for cache in (True, False):
        scheduler = engine.scheduler(max_seqs=2, max_context=80, max_step_tokens=24, chunk_sizes=(4, 16),
                                     kv_tokens=kv_tokens, prefix_cache=cache)
        requests = add_staggered(scheduler, prompts, new_tokens)
        scheduler.run_until_idle()
        assert [r.output_ids for r in requests] == alone, f"prefix_cache={cache}"
        assert scheduler.kv_reserved == 0 and scheduler.blocks.reserved_blocks == 0
        if cache:
            assert scheduler.total_cached_prompt_tokens >= 2 * BLOCK
            assert sum(r.cached_prompt_tokens for r in requests) == scheduler.total_cached_prompt_tokens
        else:
            assert scheduler.total_cached_prompt_tokens == 0 and scheduler.blocks.cached_blocks == 0


def test_a_request_waits_for_the_blocks_a_running_prompt_is_writing_then_takes_them(engine):
    """A prompt read in chunks files each block as the step that writes it is launched. A request
    arriving after the first chunk whose prompt starts with the same blocks is not admitted until
    they are all written, then takes them all instead of computing them again."""
    prompt = random_prompts([70], seed=9)[0]
    twin = prompt + [3, 4]
    alone = engine.generate([twin], 5)[0]
    scheduler = engine.scheduler(max_seqs=2, max_context=96, max_step_tokens=16, chunk_sizes=(16,), prefix_cache=True)
    first = scheduler.add(prompt, max_new_tokens=2)
    scheduler.step()  # positions 0-15 of the first prompt
    second = scheduler.add(twin, max_new_tokens=5)
    waited = 0
    while second.slot is None:
        assert first.in_prefill, "the second request waited after the first had written its prompt"
        scheduler.step()
        waited += 1
    assert waited == 4  # steps writing positions 16-31, 32-47, 48-63 and 64-69
    scheduler.run_until_idle()
    assert second.cached_prompt_tokens == 4 * BLOCK and first.cached_prompt_tokens == 0
    assert scheduler.total_prompt_tokens == len(prompt) + len(twin) - 4 * BLOCK
    assert second.output_ids == alone


def test_a_later_request_goes_past_one_waiting_for_blocks_but_not_into_its_slot(engine):
    """While a request waits for the prompt blocks a running request is writing, a later request that
    shares nothing is admitted past it where a slot is left for both; where only one slot is free,
    it stays behind the waiting one, which then takes the blocks."""
    prompt = random_prompts([70], seed=9)[0]
    twin, other = prompt + [3, 4], random_prompts([20], seed=10)[0]
    alone = [engine.generate([p], 4)[0] for p in (twin, other)]
    for slots, passes in ((3, True), (2, False)):
        scheduler = engine.scheduler(max_seqs=slots, max_context=96, max_step_tokens=16, chunk_sizes=(16,),
                                     prefix_cache=True)
        first = scheduler.add(prompt, max_new_tokens=2)
        scheduler.step()  # positions 0-15 of the first prompt
        second, third = scheduler.add(twin, max_new_tokens=4), scheduler.add(other, max_new_tokens=4)
        scheduler.step()
        assert second.slot is None and first.in_prefill
        assert (third.slot is not None) is passes, f"{slots} slots"
        scheduler.run_until_idle()
        assert second.cached_prompt_tokens == 4 * BLOCK
        assert [second.output_ids, third.output_ids] == alone


def test_prompts_added_together_read_their_shared_system_prompt_once(engine):
    system = random_prompts([50], seed=11)[0]
    prompts = [system + tail for tail in random_prompts([5, 9, 2, 7], seed=12)]
    alone = [engine.generate([p], 4)[0] for p in prompts]
    scheduler = engine.scheduler(max_seqs=4, max_context=96, max_step_tokens=64, chunk_sizes=(16, 64), prefix_cache=True)
    requests = [scheduler.add(p, max_new_tokens=4) for p in prompts]
    scheduler.run_until_idle()
    assert [r.output_ids for r in requests] == alone
    shared = 3 * BLOCK  # the system prompt's full blocks
    assert [r.cached_prompt_tokens for r in requests] == [0, shared, shared, shared]
    assert scheduler.total_prompt_tokens == sum(map(len, prompts)) - 3 * shared


def test_a_shared_system_prompt_lets_more_requests_run_at_once_in_a_small_pool(engine):
    """A pool of 10 blocks; each request reserves 5 (64 shared tokens, 8 of its own, 8 to answer).
    Charged once, the shared 4 blocks leave room for 6 requests at once, where full charges allow 2."""
    system = random_prompts([64], seed=14)[0]
    prompts = [system + tail for tail in random_prompts([8] * 6, seed=15)]
    alone = [engine.generate([p], 8)[0] for p in prompts]
    for cache, most in ((True, 6), (False, 2)):
        scheduler = engine.scheduler(max_seqs=6, max_context=80, kv_tokens=160, prefix_cache=cache)
        requests = [scheduler.add(p, max_new_tokens=8) for p in prompts]
        running = steps = 0
        while scheduler.has_work and steps < 200:
            scheduler.step()
            running, steps = max(running, len(scheduler.running)), steps + 1
        assert running == most, f"prefix_cache={cache}"
        assert [r.output_ids for r in requests] == alone
        assert scheduler.kv_reserved == 0


def test_prompts_sharing_nothing_are_admitted_together(engine):
    prompts = random_prompts([40, 40, 40], seed=13)
    scheduler = engine.scheduler(max_seqs=3, max_context=64, max_step_tokens=128, prefix_cache=True)
    requests = [scheduler.add(p, max_new_tokens=2) for p in prompts]
    scheduler.step()
    assert all(r.slot is not None for r in requests)


def test_prompts_with_images_are_left_out(engine):
    scheduler = engine.scheduler(max_seqs=1, max_context=96, prefix_cache=True)
    prompt = random_prompts([40], seed=7)[0]
    list(engine.stream(prompt, 4, scheduler=scheduler))
    plain = Request(prompt + [1])
    pictured = Request(prompt + [1], multimodal=MultimodalInput(torch.zeros(3, 41, dtype=torch.long), 0,
                                                                torch.zeros(0, dtype=torch.long)))
    assert len(scheduler._cached_prefix(plain)) == 2 and scheduler._cached_prefix(pictured) == []


def test_the_prefix_cache_can_be_turned_off(engine, monkeypatch):
    monkeypatch.setenv("VRAMSHARD_PREFIX_CACHE", "off")
    assert not engine.scheduler(max_seqs=1, max_context=64).prefix_cache
    monkeypatch.delenv("VRAMSHARD_PREFIX_CACHE")
    assert engine.scheduler(max_seqs=1, max_context=64).prefix_cache


def test_the_benchmark_gives_the_same_tokens_both_ways_and_takes_the_history_from_the_cache(tmp_path, monkeypatch):
    import json
    import sys

    from benchmarks import prefix_cache

    out = tmp_path / "prefix.json"
    monkeypatch.setattr(sys, "argv", ["prefix_cache", "--shape", "tiny-llama", "--device", "cpu", "--turns", "3",
                                      "--system", "40", "--message", "8", "--answer", "4", "--ctx", "128",
                                      "--batch", "3", "--profile", "docs/profiles/h200-run26b.json", "--json", str(out)])
    given = {}
    build = prefix_cache.Engine.from_weights

    def from_weights(*args, **kwargs):  # (the planner needs a Profile, not its path: only a GPU plans)
        given.update(kwargs)
        return build(*args, **kwargs)

    monkeypatch.setattr(prefix_cache.Engine, "from_weights", from_weights)
    prefix_cache.main()
    from vramshard.profile.query import Profile

    assert isinstance(given["profile"], Profile)
    cells = json.loads(out.read_text())["cells"]
    assert [c["same_tokens"] for c in cells] == [True] * 3
    assert cells[0]["cached_tokens"] == 0 and cells[1]["cached_tokens"] == 32 and cells[2]["cached_tokens"] == 48
    without, with_cache = json.loads(out.read_text())["batch"]
    assert with_cache["same_tokens"] and without["prompt_tokens"] == with_cache["prompt_tokens"] == 3 * 48
    assert without["computed_prompt_tokens"] == 3 * 48 and without["cached_prompt_tokens"] == 0
    assert with_cache["cached_prompt_tokens"] == 2 * 32  # the 40 shared tokens' two full blocks, twice


@pytest.mark.parametrize("placement", ["gpu", "stream", "static"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_a_chats_next_turn_from_the_cache_gives_the_tokens_of_computing_it(placement, tiny_model_dir):
    """On the GPU (graphs, the paged Triton kernel, overlapped steps), with weights resident, streamed
    or on the CPU beside GPU attention: the next turn over cached blocks equals a fresh generation."""
    from vramshard import Engine

    engine = Engine.load(tiny_model_dir("qwen3"), device="cuda", placement=placement, max_context=256)
    first = random_prompts([45], seed=3)[0]
    conversation = engine.scheduler(max_seqs=1, max_context=160, prefix_cache=True)
    answer = list(engine.stream(first, 12, scheduler=conversation))
    second = first + answer + [5, 6, 7]
    assert list(engine.stream(second, 12, scheduler=conversation)) == engine.generate([second], 12)[0]
    assert conversation.total_cached_prompt_tokens == 48
