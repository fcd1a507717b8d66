"""GPU attention over a host KV cache, staged through a second cache (a CPU cache stands in for VRAM
here): same outputs and same host cache as attention straight over the host cache; placement,
executor rules, VRAM accounting, estimator and planner choices."""

import copy

import pytest
import torch

from vramshard import Engine
from vramshard.errors import InvalidInputError
from vramshard.layers.step import Step
from vramshard.plan.estimator import Estimator
from vramshard.plan.memory import kv_staging_bytes, tiered_vram_need, vram_need
from vramshard.plan.placement import (CPU, GPU_RESIDENT_HOST_KV, GPU_STREAMED, GPU_STREAMED_HOST_KV, Placement,
                                      TieredPlacement, Where, named_placement)
from vramshard.plan.planner import Planner
from vramshard.plan.tiers import Tiers
from vramshard.profile.query import synthetic
from vramshard.runtime.executor import Executor
from vramshard.runtime.kv_cache import KVCache
from vramshard.runtime.kv_staging import KVStaging
from vramshard.shapes import shape_model

from placement_helpers import trace_logits

GiB = 2**30
BLOCK = 16


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return Engine.load(tiny_model_dir("llama"), device="cpu", dtype="float32")


def _attention(engine):
    sublayer = engine.model["attn[1]"]
    return sublayer, engine.executor.host[sublayer.name].views


def _caches(engine, blocks=12):
    a = engine.model.args
    host = KVCache([1], slots=1, max_ctx=blocks * BLOCK, kv_heads=a.num_key_value_heads, head_dim=a.head_dim,
                   dtype=torch.float32, device_of=lambda layer: "cpu")
    for layer in (host(1),):  # a cache that already holds other sequences' keys: copies must not disturb them
        layer.k.normal_()
        layer.v.normal_()
    return host, copy.deepcopy(host)


def _staging(engine, positions=12 * BLOCK):
    a = engine.model.args
    return KVStaging(positions, a.num_key_value_heads, a.head_dim, torch.float32, "cpu")


def _run_both(engine, direct, staged_host, staging, starts, lengths, tables, seed):
    """One step of attention: straight over ``direct``, and staged from ``staged_host``."""
    sublayer, weights = _attention(engine)
    x = torch.randn(sum(lengths), engine.model.args.hidden_size, generator=torch.Generator().manual_seed(seed))
    slots = list(range(len(starts)))
    expected = sublayer.forward(weights, x, Step(slots, starts, lengths, None, kv_lookup=direct, block_tables=tables))
    got = staging.run(sublayer, weights, x, Step(slots, starts, lengths, None, kv_lookup=staged_host,
                                                 block_tables=tables))
    staging.finish()
    return expected, got


def _same_cache(a, b):
    assert torch.equal(a(1).k, b(1).k) and torch.equal(a(1).v, b(1).v)


def test_first_chunk_then_later_chunk_match_direct_attention(engine):
    direct, staged_host = _caches(engine)
    staging = _staging(engine)
    table = [[3, 4, 5, 6]]  # consecutive host blocks, not starting at 0
    expected, got = _run_both(engine, direct, staged_host, staging, [0], [20], table, seed=0)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    _same_cache(direct, staged_host)
    assert staging.bytes_in == 0  # a first chunk has no prefix to copy in
    # A later chunk: the prefix (two blocks, the second one partial) is copied in first.
    expected, got = _run_both(engine, direct, staged_host, staging, [20], [13], table, seed=1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    _same_cache(direct, staged_host)
    assert staging.bytes_in > 0 and staging.bytes_out > 0


def test_batch_of_two_with_scattered_blocks_matches_direct_attention(engine):
    direct, staged_host = _caches(engine)
    staging = _staging(engine)
    tables = [[9, 2, 7], [0, 11, 5, 1]]  # paged, out of order, interleaved between the sequences
    expected, got = _run_both(engine, direct, staged_host, staging, [0, 0], [21, 40], tables, seed=2)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    _same_cache(direct, staged_host)
    expected, got = _run_both(engine, direct, staged_host, staging, [21, 40], [5, 1], tables, seed=3)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    _same_cache(direct, staged_host)


def test_a_new_sequence_between_two_that_go_on_matches_direct_attention(engine):
    """One gather and one copy bring in every prefix: the staging blocks between them (here a new sequence's
    first chunk) come along with another block's keys, which the attention overwrites and masks."""
    direct, staged_host = _caches(engine)
    staging = _staging(engine)
    a, b, c = [9, 2, 7], [0, 11], [5, 1, 3]
    expected, got = _run_both(engine, direct, staged_host, staging, [0, 0], [19, 35], [a, c], seed=20)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    expected, got = _run_both(engine, direct, staged_host, staging, [19, 0, 35], [1, 24, 1], [a, b, c], seed=21)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    _same_cache(direct, staged_host)
    assert staging.bytes_in > 0


def test_a_page_locked_host_cache_is_copied_in_place_by_runs_of_blocks(engine, monkeypatch):
    """Where the copy engine may read the host cache in place (page-locked; said here on the CPU), prefixes whose
    blocks lie in long runs are copied run by run, no gather; a step whose runs are short (a scattered table) is
    gathered as before; both match direct attention."""
    from vramshard.runtime import kv_staging

    monkeypatch.setattr(kv_staging, "DIRECT_RUN_BLOCKS", 2)
    a = engine.model.args
    direct, staged_host = _caches(engine, blocks=16)
    staging = KVStaging(16 * BLOCK, a.num_key_value_heads, a.head_dim, torch.float32, "cpu", in_place=True)
    gathers = []
    monkeypatch.setattr(kv_staging.torch, "index_select",
                        lambda *args, _real=torch.index_select, **kw: gathers.append(1) or _real(*args, **kw))
    tables = [[2, 3, 4, 5], [8, 9, 10, 11]]  # each sequence's blocks consecutive: one run each
    expected, got = _run_both(engine, direct, staged_host, staging, [0, 0], [50, 40], tables, seed=30)
    staging.k.zero_(), staging.v.zero_()  # (other layers take the staging cache between a layer's steps)
    expected, got = _run_both(engine, direct, staged_host, staging, [50, 40], [1, 1], tables, seed=31)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not gathers and staging.bytes_in == 2 * (4 + 3) * BLOCK * a.num_key_value_heads * a.head_dim * 4
    scattered = [[12, 0, 14, 1], [6, 13, 7, 15]]  # runs of one block: gathered
    direct, staged_host = _caches(engine, blocks=16)
    expected, got = _run_both(engine, direct, staged_host, staging, [0, 0], [50, 40], scattered, seed=32)
    staging.k.zero_(), staging.v.zero_()
    expected, got = _run_both(engine, direct, staged_host, staging, [50, 40], [1, 1], scattered, seed=33)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert gathers
    _same_cache(direct, staged_host)


def test_a_step_larger_than_the_staging_cache_is_refused(engine):
    from vramshard.errors import BudgetError

    direct, staged_host = _caches(engine)
    staging = _staging(engine, positions=2 * BLOCK)
    with pytest.raises(BudgetError, match="KV staging"):
        _run_both(engine, direct, staged_host, staging, [0], [40], [[0, 1, 2]], seed=4)


def test_write_backs_in_flight_land_before_the_host_cache_is_read(engine):
    """With one write-back buffer and no finish() in between, each layer's rows still land in time."""
    direct, staged_host = _caches(engine)
    a = engine.model.args
    staging = KVStaging(12 * BLOCK, a.num_key_value_heads, a.head_dim, torch.float32, "cpu", buffers=1)
    sublayer, weights = _attention(engine)
    x = torch.randn(8, a.hidden_size)
    for start in (0, 8):
        step = Step([0], [start], [8], None, kv_lookup=staged_host, block_tables=[[4, 5]])
        staging.run(sublayer, weights, x, step)
        sublayer.forward(weights, x, Step([0], [start], [8], None, kv_lookup=direct, block_tables=[[4, 5]]))
    staging.finish()
    _same_cache(direct, staged_host)


def test_layers_gather_their_prefix_into_pinned_buffers_in_turn(engine):
    """Layer after layer, the host gathers each cached prefix into the next of KV_IN_BUFFERS pinned buffers (it
    gathers layer L+1's while the copy engine reads layer L's), and every layer's attention still matches."""
    from vramshard.runtime.kv_staging import KV_IN_BUFFERS

    direct, staged_host = _caches(engine)
    staging = _staging(engine)
    table = [[3, 4, 5, 6]]
    _run_both(engine, direct, staged_host, staging, [0], [20], table, seed=5)  # the prompt: no prefix yet
    used = []
    for seed in range(2 * KV_IN_BUFFERS):
        expected, got = _run_both(engine, direct, staged_host, staging, [20 + seed], [1], table, seed=6 + seed)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        used.append(staging._in[(staging._next_in - 1) % KV_IN_BUFFERS][0].data_ptr())
    assert KV_IN_BUFFERS >= 2 and len(set(used[:KV_IN_BUFFERS])) == KV_IN_BUFFERS
    assert used[KV_IN_BUFFERS:] == used[:KV_IN_BUFFERS]
    _same_cache(direct, staged_host)


# ---------------------------------------------------------------------------- the executor
def _tiered(model) -> TieredPlacement:
    """Decode: attention on the CPU; prompt chunks: attention on the GPU over the host KV cache."""
    def place(staged):
        return Placement("mix", tuple(
            (s.name, CPU if s.kind == "embed" else GPU_STREAMED_HOST_KV if s.kind == "attn" and staged
             else CPU if s.kind == "attn" else GPU_STREAMED) for s in model))
    return TieredPlacement((1, 64), (place(False), place(True)), (None, None))


def test_executor_mixes_cpu_and_staged_attention_with_same_logits(engine):
    expected = trace_logits(engine, prefill_chunk=5)
    tiered = _tiered(engine.model)
    executor = Executor(engine.model, engine.executor.host, tiered, max_context=64, simulate_gpu=True)
    assert executor.kv_layers_on_gpu == set() and executor.staging is not None
    assert executor.need.kv == 0 and executor.need.kv_staging == kv_staging_bytes(engine.model, 1, 64)
    assert "KV staging" in executor.describe()
    simulated = copy.copy(engine)
    simulated.executor = executor
    got = trace_logits(simulated, prefill_chunk=5)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_executor_refuses_kv_that_moves_between_tiers(engine):
    model = engine.model
    in_vram = Placement("v", tuple((s.name, Where("gpu", "stream") if s.kind != "embed" else CPU) for s in model))
    on_host = Placement("h", tuple((s.name, CPU) for s in model))
    with pytest.raises(InvalidInputError, match="do not move between tiers"):
        Executor(model, engine.executor.host, TieredPlacement((1, 64), (on_host, in_vram), (None, None)),
                 simulate_gpu=True)
    wrong = Placement("w", tuple((s.name, GPU_STREAMED_HOST_KV if s.kind == "ffn" else CPU) for s in model))
    with pytest.raises(InvalidInputError, match="only attention"):
        Executor(model, engine.executor.host, wrong, simulate_gpu=True)


# ---------------------------------------------------------------------------- plan data
def test_placement_json_round_trip_and_validation():
    triples = [("embed", "embed", None), ("attn[0]", "attn", 0), ("ffn[0]", "ffn", 0), ("head", "head", None)]
    p = named_placement("stream-hostkv", triples, 1)
    assert p["attn[0]"] == GPU_STREAMED_HOST_KV and p.staged_kv_names() == ["attn[0]"]
    assert Placement.from_json(p.to_json()) == p
    assert "kv@host" in p.to_json() and "+kv@cpu" in str(p) and "GPU attention over host KV" in p.summary()
    tiered = TieredPlacement((1, 512), (named_placement("stream", triples, 1), p), (None, 4))
    assert TieredPlacement.from_json(tiered.to_json()) == tiered
    assert Where.from_list(GPU_RESIDENT_HOST_KV.to_list()) == GPU_RESIDENT_HOST_KV
    assert not GPU_STREAMED_HOST_KV.kv_in_vram and GPU_STREAMED.kv_in_vram and not CPU.kv_in_vram
    with pytest.raises(InvalidInputError, match="kv=host"):
        Where("cpu", "host", kv="host")
    with pytest.raises(InvalidInputError, match="kv="):
        Where("gpu", "stream", kv="vram")


def test_vram_accounting_counts_staging_not_kv():
    model = shape_model("nemo-8b")
    triples = [(s.name, s.kind, s.layer) for s in model]
    plain = named_placement("stream", triples, model.args.num_hidden_layers)
    staged = named_placement("stream-hostkv", triples, model.args.num_hidden_layers)
    a, b = vram_need(model, plain, 1, 1024, 512), vram_need(model, staged, 1, 1024, 512)
    one_layer = 2 * 1024 * model.args.num_key_value_heads * model.args.head_dim * 2
    assert a.kv == model.args.num_hidden_layers * one_layer and a.kv_staging == 0
    assert b.kv == 0 and b.kv_staging == one_layer == kv_staging_bytes(model, 1, 1024)
    assert b.total == a.total - a.kv + one_layer
    cpu = Placement("cpu", tuple((n, CPU) for n, _, _ in triples))
    tiered = tiered_vram_need(model, TieredPlacement((1, 512), (cpu, staged), (None, None)), 1, 1024, 512)
    assert tiered.kv == 0 and tiered.kv_staging == one_layer
    assert "KV staging" in tiered.breakdown()


def test_estimator_costs_the_staging_copies():
    model = shape_model("nemo-8b")
    profile = synthetic(cpu_gflops=1500, gpu_gflops=200_000, h2d_gbps=50, cpu_mem_gbps=80, gpu_mem_gbps=1500)
    triples = [(s.name, s.kind, s.layer) for s in model]
    plain = named_placement("stream", triples, model.args.num_hidden_layers)
    staged = named_placement("stream-hostkv", triples, model.args.num_hidden_layers)
    est = Estimator(model, profile)
    # A first chunk copies nothing in but writes its keys back; a later chunk copies its prefix in.
    first, later = est.simulate(staged, 512, 512), est.simulate(staged, 512, 4096)
    assert first.copy_busy > est.simulate(plain, 512, 512).copy_busy
    assert later.copy_busy - est.simulate(plain, 512, 4096).copy_busy > first.copy_busy - \
        est.simulate(plain, 512, 512).copy_busy


# ---------------------------------------------------------------------------- the planner
def test_planner_runs_prompt_attention_on_gpu_over_host_kv_when_cpu_is_slow():
    """A CPU slow at compute-bound work: KV in host memory (forced), yet tier 512's attention runs on
    the GPU over it, decode keeps what is predicted faster, and the budget holds."""
    model = shape_model("nemo-8b")
    profile = synthetic(cpu_gflops=300, gpu_gflops=200_000, h2d_gbps=50, cpu_mem_gbps=80, gpu_mem_gbps=1500)
    budget = 2 * GiB
    result = Planner(model, profile, budget, context=1024, tiers=Tiers((1, 512)), kv_on_gpu=False).plan()
    prompt = result.tiers[512].placement
    attention = [s.name for s in model if s.kind == "attn"]
    assert all(prompt[n].compute == "gpu" and prompt[n].stages_kv for n in attention)
    assert result.need.kv == 0 and result.need.kv_staging == kv_staging_bytes(model, 1, 1024)
    assert result.need.total <= budget
    need = tiered_vram_need(model, result.tiered(), 1, 1024, 512)
    assert need.total <= budget and need.kv_staging == result.need.kv_staging
    # Same plan without the option (attention beside its host KV cache, on the CPU) is slower.
    cpu_attention = Placement("x", tuple((n, CPU if n in attention else w) for n, w in prompt.where))
    est = Estimator(model, profile)
    assert est.simulate(prompt, 512, 1024).seconds < est.simulate(cpu_attention, 512, 1024).seconds
