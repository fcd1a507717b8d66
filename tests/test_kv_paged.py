"""The paged KV cache: block allocation, attention through block tables, waiting for blocks."""

import pytest
import torch
import torch.nn.functional as F

from vramshard import Engine
from vramshard.layers.attention import attend
from vramshard.layers.step import Step
from vramshard.runtime.kv_cache import BlockAllocator, KVCache
from vramshard.runtime.request import RequestStatus

from scheduling_helpers import random_prompts

BLOCK = 16


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return Engine.load(tiny_model_dir("qwen3"), device="cpu")


def _prompts(lengths):
    return random_prompts(lengths)


# ---------------------------------------------------------------------------- the allocator
def test_blocks_are_reserved_taken_on_demand_and_reused():
    blocks = BlockAllocator(num_blocks=6, block_size=4)
    blocks.admit("a", 10)  # 3 blocks reserved, none taken yet
    assert blocks.reserved_blocks == 3 and blocks.used_blocks == 0 and blocks.table("a") == []
    assert blocks.grow("a", 5) == [0, 1] and blocks.used_blocks == 2
    blocks.admit("b", 12)
    assert not blocks.can_admit(1)  # every block is reserved, though only 2 are taken
    assert blocks.grow("b", 3) == [2]
    assert blocks.grow("a", 10) == [0, 1, 3]  # block 2 is b's: a's cache is no longer contiguous
    with pytest.raises(ValueError, match="beyond"):
        blocks.grow("a", 13)
    blocks.release("a")
    assert blocks.free_blocks == 5 and blocks.reserved_blocks == 3 and blocks.can_admit(12)
    blocks.admit("c", 8)
    assert blocks.grow("c", 8) == [0, 1]  # a's blocks come back
    blocks.release("b"), blocks.release("c"), blocks.release("unknown")
    assert blocks.free_blocks == 6 and blocks.reserved_blocks == 0


# ---------------------------------------------------------------------------- attention
def _reference(q, keys, values, start):
    """Causal attention of q [T, H, D] (positions start..) over keys [L, Hkv, D]."""
    T, H, _ = q.shape
    rep = H // keys.shape[1]
    k = keys.repeat_interleave(rep, 1).transpose(0, 1)
    v = values.repeat_interleave(rep, 1).transpose(0, 1)
    mask = torch.arange(keys.shape[0])[None, :] <= torch.arange(start, start + T)[:, None]
    return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask).transpose(0, 1)


@pytest.mark.parametrize("lengths,starts", [((5,), (0,)), ((1,), (37,)), ((9,), (20,)), ((3, 1, 17), (0, 40, 6))])
def test_attention_through_scattered_block_tables(lengths, starts):
    torch.manual_seed(0)
    H, Hkv, D = 4, 2, 8
    cache = KVCache([0], slots=1, max_ctx=12 * BLOCK, kv_heads=Hkv, head_dim=D, dtype=torch.float32,
                    device_of=lambda layer: "cpu")
    order = torch.randperm(12).tolist()  # scattered, out-of-order blocks
    tables = [order[0:4], order[4:8], order[8:12]][: len(lengths)]
    history = [torch.randn(s + n, Hkv, D) for s, n in zip(starts, lengths)]  # keys of positions 0..end
    values = [torch.randn(s + n, Hkv, D) for s, n in zip(starts, lengths)]
    layer = cache(0)
    for table, keys, vals, start in zip(tables, history, values, starts):  # earlier positions already cached
        for pos in range(start):
            layer.k[table[pos // BLOCK], pos % BLOCK] = keys[pos]
            layer.v[table[pos // BLOCK], pos % BLOCK] = vals[pos]
    q = torch.randn(sum(lengths), H, D)
    k = torch.cat([keys[s:] for keys, s in zip(history, starts)])
    v = torch.cat([vals[s:] for vals, s in zip(values, starts)])
    step = Step([0] * len(lengths) if len(lengths) == 1 else list(range(len(lengths))), list(starts), list(lengths),
                kv_lookup=cache, block_tables=tables)
    out = attend(q, k, v, layer, step)
    expected, row = [], 0
    for keys, vals, start, n in zip(history, values, starts, lengths):
        expected.append(_reference(q[row : row + n], keys, vals, start))
        row += n
    torch.testing.assert_close(out, torch.cat(expected), rtol=1e-5, atol=1e-5)
    for table, keys, start, n in zip(tables, history, starts, lengths):  # the new keys went to their blocks
        for pos in range(start, start + n):
            torch.testing.assert_close(layer.k[table[pos // BLOCK], pos % BLOCK], keys[pos])


def test_steps_without_tables_use_one_row_per_slot():
    cache = KVCache([0], slots=3, max_ctx=20, kv_heads=1, head_dim=4, dtype=torch.float32,
                    device_of=lambda layer: "cpu")
    assert cache.blocks_per_slot == 2 and cache.num_blocks == 6 and cache.num_tokens == 96
    k = torch.randn(3, 1, 4)
    attend(torch.randn(3, 1, 4), k, k, cache(0), Step.single(5, 3, slot=2, kv_lookup=cache))
    keys, _ = cache.slot_rows(0, 2)
    torch.testing.assert_close(keys[5:8], k)
    assert cache(0).k[:4].abs().sum() == 0  # slots 0 and 1 untouched


# ---------------------------------------------------------------------------- the scheduler on a paged pool
def test_interleaved_growth_scatters_blocks_and_keeps_results(engine):
    prompts = _prompts((20, 33, 5))
    alone = [engine.generate([p], 30)[0] for p in prompts]
    scheduler = engine.scheduler(max_seqs=3, max_context=96, max_step_tokens=8)  # prompts read 8 tokens at a time
    requests = [scheduler.add(p, max_new_tokens=30) for p in prompts]
    scattered = False
    while scheduler.has_work:
        scheduler.step()
        for r in scheduler.running:
            table = scheduler.blocks.table(r.slot)
            scattered |= any(b != table[0] + i for i, b in enumerate(table))
    assert scattered  # sequences grew side by side, so some cache is not contiguous
    assert [r.output_ids for r in requests] == alone
    assert scheduler.blocks.used_blocks == 0 and scheduler.blocks.reserved_blocks == 0


def test_new_requests_wait_for_blocks_and_reuse_them(engine):
    prompts = _prompts((40, 30, 10))
    scheduler = engine.scheduler(max_seqs=3, max_context=64, kv_tokens=64)  # 4 blocks of 16
    first = scheduler.add(prompts[0], max_new_tokens=8)  # 48 positions: 3 blocks
    second = scheduler.add(prompts[1], max_new_tokens=8)  # 38: 3 blocks, must wait
    scheduler.step()
    assert first.status is RequestStatus.RUNNING and second.status is RequestStatus.WAITING
    first_blocks = set(scheduler.blocks.table(first.slot))
    assert scheduler.blocks.used_blocks == len(first_blocks) == 3  # the prompt's 40 positions: 3 blocks now
    while first.status is RequestStatus.RUNNING:
        scheduler.step()
        assert second.status is RequestStatus.WAITING
    scheduler.step()
    assert second.status is RequestStatus.RUNNING
    assert set(scheduler.blocks.table(second.slot)) <= first_blocks | set(range(4))
    assert set(scheduler.blocks.table(second.slot)) & first_blocks  # freed blocks came back
    third = scheduler.add(prompts[2], max_new_tokens=4)  # 14 positions: the last unreserved block
    scheduler.run_until_idle()
    assert [r.output_ids for r in (first, second, third)] == [engine.generate([p], n)[0] for p, n in
                                                              zip(prompts, (8, 8, 4))]
    assert scheduler.stats()["kv_blocks_used"] == 0 and scheduler.kv_reserved == 0


def test_running_sequences_never_lose_blocks(engine):
    """Many short requests squeezed through a small pool: every answer equals generation alone."""
    prompts = _prompts((7, 12, 3, 18, 9, 25, 4, 14))
    alone = [engine.generate([p], 6)[0] for p in prompts]
    scheduler = engine.scheduler(max_seqs=8, max_context=48, kv_tokens=80, max_step_tokens=16, chunk_sizes=(4, 8))
    requests = [scheduler.add(p, max_new_tokens=6) for p in prompts]
    peak = 0
    while scheduler.has_work:
        scheduler.step()
        peak = max(peak, scheduler.blocks.committed_blocks)
        assert scheduler.blocks.used_blocks <= scheduler.blocks.num_blocks == 5
    assert peak <= 5 and [r.output_ids for r in requests] == alone


def test_the_lower_right_causal_bias_is_the_chunk_mask():
    """A prompt chunk after cached tokens: SDPA with the lower-right causal bias (what CUDA runs,
    in the flash kernel) sees exactly the keys of the boolean chunk mask, with GQA."""
    from torch.nn.attention.bias import causal_lower_right

    from vramshard.layers.attention import _chunk_mask

    torch.manual_seed(0)
    start, n, H, Hkv, D = 11, 6, 4, 2, 8
    q = torch.randn(1, H, n, D)
    k, v = torch.randn(1, Hkv, start + n, D), torch.randn(1, Hkv, start + n, D)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=_chunk_mask(start, n, "cpu"), enable_gqa=True)
    got = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(n, start + n), enable_gqa=True)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_the_planner_counts_flash_only_where_the_gpu_would_run_it(monkeypatch):
    """Half precision and a head size flash takes: fused (no scores to count); float32, a head
    size over 256, or the boolean mask switched back on: the math kernel's temporaries."""
    from vramshard.layers import attention

    assert attention.fused_prompt_attention(torch.bfloat16, 128)
    assert attention.fused_prompt_attention(torch.float16, 256)
    assert not attention.fused_prompt_attention(torch.float32, 128)
    assert not attention.fused_prompt_attention(torch.bfloat16, 512)
    monkeypatch.setattr(attention, "CHUNK_ATTENTION", "mask")
    assert not attention.fused_prompt_attention(torch.bfloat16, 128)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_prompt_chunks_after_cached_tokens_match_the_reference(dtype):
    """The CUDA chunk path (lower-right causal bias; flash for half precision) over scattered blocks."""
    torch.manual_seed(0)
    H, Hkv, D, start, n = 8, 2, 64, 37, 21
    cache = KVCache([0], slots=1, max_ctx=12 * BLOCK, kv_heads=Hkv, head_dim=D, dtype=dtype,
                    device_of=lambda layer: "cuda")
    table = torch.randperm(12).tolist()
    keys, vals = torch.randn(start + n, Hkv, D), torch.randn(start + n, Hkv, D)
    layer = cache(0)
    for pos in range(start):
        layer.k[table[pos // BLOCK], pos % BLOCK] = keys[pos].to(dtype)
        layer.v[table[pos // BLOCK], pos % BLOCK] = vals[pos].to(dtype)
    q = torch.randn(n, H, D)
    step = Step([0], [start], [n], kv_lookup=cache, block_tables=[table])
    out = attend(q.to("cuda", dtype), keys[start:].to("cuda", dtype), vals[start:].to("cuda", dtype), layer, step)
    expected = _reference(q, keys.to(dtype).float(), vals.to(dtype).float(), start)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float().cpu(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_long_prompt_chunks_stay_within_a_plan_that_counts_flash_attention():
    """nemo-8b's attention (32 heads, 8 KV heads, 128 dims) in two fp16 layers: a 5K-token prompt
    in 1024-token chunks under a budget equal to the plan, whose workspace counts no score matrix
    (the flash kernel). Were any chunk to take the math kernel, its float32 scores alone
    (2 x 32 x 1024 x 5120 x 4 bytes = 1.3 GiB) would break the budget."""
    from vramshard.models import build_model
    from vramshard.plan.memory import attention_workspace_bytes, sublayer_triples, tiered_vram_need
    from vramshard.plan.placement import TieredPlacement, named_placement
    from vramshard.runtime.executor import Executor
    from vramshard.runtime.host_weights import pack_model
    from vramshard.shapes import random_weights, shape_config

    config = {**shape_config("nemo-8b"), "num_hidden_layers": 2, "vocab_size": 32000}
    model = build_model(config)
    chunk, ctx = 1024, 5120
    assert attention_workspace_bytes(model, chunk, ctx) < 64 * 2**20  # flash counted: no scores
    host = pack_model(list(model), random_weights(model), pin=True)
    placement = named_placement("gpu", sublayer_triples(model), 2)
    budget = tiered_vram_need(model, TieredPlacement.single(placement), 1, ctx, chunk, 2).total
    executor = Executor(model, host, placement, budget=budget, max_tokens=chunk, max_context=ctx)
    kv = executor.new_kv_cache(1, ctx)
    with torch.inference_mode():
        for start in range(0, ctx - chunk + 1, chunk):
            executor.forward(torch.randint(0, 32000, (chunk,)), Step.single(start, chunk, kv_lookup=kv))
    torch.cuda.synchronize()
    assert executor.peak_vram() <= budget, (executor.peak_vram(), budget, executor.need.breakdown())


def test_a_step_builds_its_rotary_tables_once_for_all_layers(monkeypatch):
    """Every attention layer of a model shares the step's cos/sin tables: one build per step, not
    one per layer (each build is a handful of small ops on the step's device)."""
    from vramshard.layers import attention
    from vramshard.plan.memory import sublayer_triples
    from vramshard.plan.placement import named_placement
    from vramshard.runtime.executor import Executor
    from vramshard.runtime.host_weights import pack_model
    from vramshard.shapes import random_weights, shape_model

    model = shape_model("tiny-llama")
    assert model.args.num_hidden_layers > 1
    host = pack_model(list(model), random_weights(model, device="cpu"), pin=False)
    executor = Executor(model, host, named_placement("cpu", sublayer_triples(model), model.args.num_hidden_layers),
                        max_tokens=8, max_context=32)
    builds = []
    real = attention.cos_sin
    monkeypatch.setattr(attention, "cos_sin", lambda *a: builds.append(1) or real(*a))
    kv = executor.new_kv_cache(1, 32)
    executor.forward(torch.arange(8), Step.single(0, 8, kv_lookup=kv))
    executor.forward(torch.tensor([3]), Step.single(8, 1, kv_lookup=kv))
    assert len(builds) == 2  # one per step
