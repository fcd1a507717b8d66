"""Fixed-shape decode forward and CUDA-graph runner (runtime/graphs.py, layers/static_attention.py).

On the CPU the runner's ``capture=False`` mode runs the same fixed-shape forward with the same
padded buffers eagerly; it must give the logits of the normal path. ``gpu`` tests capture and replay.
"""

import logging

import pytest
import torch

from vramshard import Engine
from vramshard.layers.step import Step
from vramshard.plan.memory import sublayer_triples
from vramshard.plan.placement import named_placement
from vramshard.runtime import graphs as graphs_module
from vramshard.runtime.graphs import (SEGMENT, SMALL_SEGMENT, DecodeGraphs, batch_bucket, capture_bytes,
                                      decode_uncovered, key_bucket, key_buckets, pack_decode_inputs, resident_runs)

gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = [[5, 17, 42, 3, 77], [9, 60, 31, 2, 88, 14, 7, 1, 55, 23, 90, 4, 4, 61, 18, 33, 70, 2, 9],
           [41, 12, 80, 6, 6, 30, 21, 11, 8, 19, 50]]
# Scattered, out-of-order blocks of 16 positions (the pool of 4 slots x 64 positions has 16 blocks).
TABLES = [[7, 2, 12], [0, 9, 4], [15, 5, 10]]
# Which sequences decode at each step: 3 in bucket 4, then 2, then 1, then 3 again.
SCHEDULE = [(0, 1, 2)] * 4 + [(0, 2)] * 2 + [(1,)] + [(0, 1, 2)] * 2


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    made = {}

    def get(arch):
        if arch not in made:
            made[arch] = Engine.load(tiny_model_dir(arch), device="cpu", dtype="float32")
        return made[arch]

    return get


def _host_graphs(engine, **kw) -> DecodeGraphs:
    weights = {name: packed.views for name, packed in engine.executor.host.items()}
    kw.setdefault("smallest_keys", 16)
    return DecodeGraphs(weights, "cpu", max_context=64, capture=False, **kw)


def _prefill(executor, kv, tables):
    for prompt, table in zip(PROMPTS, tables):
        step = Step([0], [0], [len(prompt)], kv_lookup=kv, block_tables=None if table is None else [table])
        executor.forward(torch.tensor(prompt), step)


def _decode_trace(engine, graphs, paged=True, schedule=SCHEDULE, run=None, cache_tol=1e-5):
    """Teacher-forced decode on two KV caches, the normal path against the runner; returns the max
    logit difference, and checks the caches agree afterwards."""
    executor = engine.executor
    tables = TABLES if paged else [None] * len(PROMPTS)
    ref_kv, kv = executor.new_kv_cache(4, 64), executor.new_kv_cache(4, 64)
    _prefill(executor, ref_kv, tables)
    _prefill(executor, kv, tables)
    cached = [len(p) for p in PROMPTS]
    tokens = [p[-1] for p in PROMPTS]
    worst = 0.0
    for seqs in schedule:
        ids = torch.tensor([tokens[s] for s in seqs])
        common = dict(slots=list(seqs), starts=[cached[s] for s in seqs], lengths=[1] * len(seqs),
                      logit_rows=list(range(len(seqs))),
                      block_tables=[TABLES[s] for s in seqs] if paged else None)
        expected = executor.forward(ids, Step(**common, kv_lookup=ref_kv))
        got = (run or graphs.run)(executor.token_sublayers, ids, Step(**common, kv_lookup=kv))
        assert got is not None and got.shape == expected.shape
        worst = max(worst, (got - expected).abs().max().item())
        for i, s in enumerate(seqs):
            tokens[s] = int(expected[i].argmax())
            cached[s] += 1
    for layer in ref_kv.layers:
        torch.testing.assert_close(kv(layer).k, ref_kv(layer).k, rtol=1e-4, atol=cache_tol)
        torch.testing.assert_close(kv(layer).v, ref_kv(layer).v, rtol=1e-4, atol=cache_tol)
    return worst


# ---------------------------------------------------------------------------- buckets
def test_buckets():
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 33, 64)] == [1, 2, 4, 4, 8, 64, 64]
    assert batch_bucket(65) is None
    assert key_buckets(100, 16) == (16, 32, 64, 100)
    assert key_buckets(64, 64) == (64,)
    buckets = key_buckets(4096)
    assert buckets[0] == 64 and buckets[-1] == 4096
    assert key_bucket(1, buckets) == 64 and key_bucket(65, buckets) == 128 and key_bucket(4096, buckets) == 4096
    assert key_bucket(4097, buckets) is None


def test_capture_estimate_grows_with_the_bucket_in_whole_segments():
    from vramshard.shapes import shape_model

    sublayers = list(shape_model("nemo-8b"))
    small = capture_bytes(sublayers, 1, 64, torch.float16)
    assert small % SEGMENT == 0 and small >= 2 * SEGMENT
    # One sequence at 2048 keys: the H200 run's pool was 56 MiB (nemo-8b fp16); the estimate covers it.
    assert capture_bytes(sublayers, 1, 2048, torch.float16) == 80 * 2**20
    assert capture_bytes(sublayers, 8, 4096, torch.float16) > capture_bytes(sublayers, 8, 64, torch.float16) >= small
    assert capture_bytes(sublayers, 64, 4096, torch.float16) > capture_bytes(sublayers, 8, 4096, torch.float16)
    assert capture_bytes(sublayers, 64, 4096, torch.float32) > capture_bytes(sublayers, 64, 4096, torch.float16)


def test_pack_inputs_pads_rows_with_row_zero_writes():
    out = torch.full((4, 4 + 3), -1, dtype=torch.long)
    step = Step([0, 1, 2], [17, 3, 40], [1, 1, 1], block_tables=[[7, 2], [0], [15, 5, 10]])
    pack_decode_inputs(step, (16, 4), out, tokens=torch.tensor([11, 12, 13]))
    assert out[:, 0].tolist() == [11, 12, 13, 0]
    assert out[:, 1].tolist() == [17, 3, 40, 0]
    assert out[:, 2].tolist() == [2 * 16 + 1, 0 * 16 + 3, 10 * 16 + 8, 2 * 16 + 1]  # padded row: row 0's
    assert out[:, 3].tolist() == [0, 1, 2, 0]
    assert out[:, 4:].tolist() == [[7, 2, 7], [0, 0, 0], [15, 5, 10], [7, 2, 7]]
    # Row layout (no tables): slot s owns blocks s * 4 ...
    pack_decode_inputs(Step([2], [20], [1]), (16, 4), out)
    assert out[0, 2].item() == 9 * 16 + 4 and out[0, 4:].tolist() == [8, 9, 10]


def test_resident_runs(engines):
    model = engines("llama").model
    triples, layers = sublayer_triples(model), model.args.num_hidden_layers
    assert resident_runs(named_placement("gpu", triples, layers), list(model)) == [(0, len(model))]
    assert resident_runs(named_placement("layers:1", triples, layers), list(model)) == [(1, 3)]
    # Attention in VRAM, FFNs on the CPU: each attention is a run of its own (fewer host launches).
    attention = [i for i, s in enumerate(model) if s.kind == "attn"]
    assert resident_runs(named_placement("static", triples, layers), list(model)) == [(i, i + 1) for i in attention]
    assert resident_runs(named_placement("static", triples, layers), list(model), shortest=2) == []
    assert resident_runs(named_placement("stream", triples, layers), list(model)) == []
    # The runner keeps only runs whose weights it holds, and remembers them per placement.
    sublayers = list(model)
    held = {s.name: {} for s in sublayers if s.name != "attn[1]"}
    graphs = DecodeGraphs(held, "cpu", max_context=64, capture=False)
    gpu = named_placement("gpu", triples, layers)
    assert graphs.runs(gpu, sublayers) == {}
    assert graphs.runs(named_placement("layers:1", triples, layers), sublayers) == {1: 3}
    assert graphs.runs(gpu, sublayers) is graphs.runs(gpu, sublayers)


# ---------------------------------------------------------------------------- the fixed-shape forward
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2", "mistral", "llama_mqa_tied"])
def test_static_decode_matches_normal_path_paged(arch, engines):
    engine = engines(arch)
    graphs = _host_graphs(engine)
    assert _decode_trace(engine, graphs) < 1e-4
    assert graphs.stats.static_eager == len(SCHEDULE) and not graphs.stats.fallbacks
    # Buckets used: batch 4, 2 and 1; keys 16 and 32 (contexts 6 .. 29).
    assert {(b.batch, b.keys) for b in graphs._buckets.values()} >= {(4, 32), (2, 16), (1, 32)}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_static_decode_one_sublayer_at_a_time(arch, engines, monkeypatch):
    """Every sub-layer a run of its own (a plan that splits FFNs leaves each resident attention
    alone between them): the embedding alone, each attention, each FFN, the head alone, chained,
    give the normal path's logits and caches."""
    engine = engines(arch)
    graphs = _host_graphs(engine)
    packed = []
    real_pack = graphs_module.pack_decode_inputs
    monkeypatch.setattr(graphs_module, "pack_decode_inputs", lambda *a, **k: packed.append(1) or real_pack(*a, **k))

    def one_at_a_time(sublayers, ids, step):
        x = ids
        for sublayer in sublayers:
            x = graphs.run([sublayer], x, step)
            assert x is not None
        return x

    assert _decode_trace(engine, graphs, run=one_at_a_time) < 1e-4
    assert graphs.stats.static_eager == len(SCHEDULE) * len(engine.executor.token_sublayers)
    # The runs of a step share its indices: packed once for the runs with attention, once for the
    # others (the embedding's run packs the host token ids with them), not once a run.
    assert len(packed) == 2 * len(SCHEDULE)


@pytest.mark.parametrize("arch", ["llama", "llama_mqa_tied"])
def test_static_decode_with_the_matmul_attention_kernel(arch, engines, monkeypatch):
    """The reference's eager attention (scores in the compute dtype, float32 softmax) in place
    of masked SDPA gives the normal path's logits, padded rows and masked keys included."""
    from vramshard.layers import static_attention

    monkeypatch.setattr(static_attention, "DECODE_ATTENTION", "matmul")
    engine = engines(arch)
    graphs = _host_graphs(engine)
    assert _decode_trace(engine, graphs) < 1e-4


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_static_decode_through_torch_compile(arch, engines, caplog):
    """The fusable parts through torch.compile (the "eager" backend here: the same tracing, no code
    generation) give the normal path's logits; a compiler that fails leaves the step to eager
    kernels, said once in the log."""
    engine = engines(arch)
    graphs = _host_graphs(engine, compile_backend="eager")
    assert _decode_trace(engine, graphs) < 1e-4
    wrappers = [w for (fn, backend), w in graphs_module._compiled.items() if backend == "eager"]
    assert wrappers and all(w.failed is None for w in wrappers)

    def broken(gm, inputs):
        raise RuntimeError("no triton here")

    torch._dynamo.reset()
    graphs = _host_graphs(engine, compile_backend=broken)
    with caplog.at_level("WARNING"):
        assert _decode_trace(engine, graphs) < 1e-4
    failed = [w for (fn, backend), w in graphs_module._compiled.items() if backend is broken]
    assert failed and all(w.failed for w in failed)
    assert sum("torch.compile of" in r.message for r in caplog.records) == len(failed)


def test_compiled_segments_are_shared_by_layers_and_batch_buckets():
    """Five layers and three batch buckets: the first, middle and last stretches between attention
    cores each compile once at their first shape and once with the batch size symbolic, not once
    per layer or bucket (which would also run past torch.compile's limit of variants)."""
    import torch._dynamo.utils as dynamo_utils

    from vramshard.models import build_model
    from vramshard.runtime.graphs import decode_segments
    from vramshard.runtime.host_weights import pack_model
    from vramshard.shapes import random_weights, shape_config

    config = shape_config("tiny-llama")
    config["num_hidden_layers"] = 5
    model = build_model(config, torch.float32)
    engine = Engine.from_host(model, pack_model(list(model), random_weights(model), pin=False, splittable=False),
                              device="cpu", max_context=64)
    pieces = decode_segments(engine.executor.token_sublayers[1:])
    assert [type(p).__name__ for p in pieces] == ["_Segment", "Attention"] * 5 + ["_Segment"]
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    graphs = _host_graphs(engine, compile_backend="eager")
    kv = engine.executor.new_kv_cache(4, 64)
    for rows in (1, 3, 2, 4, 1, 3):
        step = Step(list(range(rows)), [5] * rows, [1] * rows, list(range(rows)), kv_lookup=kv)
        assert graphs.run(engine.executor.token_sublayers, torch.arange(rows), step) is not None
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 6


def test_static_decode_matches_normal_path_row_layout(engines):
    engine = engines("qwen3")
    graphs = _host_graphs(engine)
    assert _decode_trace(engine, graphs, paged=False, schedule=[(0, 1, 2)] * 3 + [(2,)] * 2) < 1e-4


def test_logit_rows_subset(engines):
    engine = engines("llama")
    graphs = _host_graphs(engine)
    kv, ref_kv = engine.executor.new_kv_cache(4, 64), engine.executor.new_kv_cache(4, 64)
    _prefill(engine.executor, kv, TABLES)
    _prefill(engine.executor, ref_kv, TABLES)
    ids = torch.tensor([3, 4, 5])
    common = dict(slots=[0, 1, 2], starts=[len(p) for p in PROMPTS], lengths=[1, 1, 1], logit_rows=[2, 0],
                  block_tables=TABLES)
    expected = engine.executor.forward(ids, Step(**common, kv_lookup=ref_kv))
    got = graphs.run(engine.executor.token_sublayers, ids, Step(**common, kv_lookup=kv))
    assert got.shape == (2, engine.model.args.vocab_size)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_run_of_hidden_states(engines):
    """A run that starts and ends inside the model (as the resident part of ``layers:N``)."""
    engine = engines("qwen3")
    executor = engine.executor
    run = [s for s in engine.model if s.kind in ("attn", "ffn")]
    graphs = _host_graphs(engine)
    kv, ref_kv = executor.new_kv_cache(4, 64), executor.new_kv_cache(4, 64)
    _prefill(executor, kv, TABLES)
    _prefill(executor, ref_kv, TABLES)
    torch.manual_seed(0)
    x = torch.randn(3, engine.model.args.hidden_size)
    common = dict(slots=[0, 1, 2], starts=[len(p) for p in PROMPTS], lengths=[1, 1, 1], block_tables=TABLES)
    expected = executor.run_sublayers([s.name for s in run], x, Step(**common, kv_lookup=ref_kv))
    got = graphs.run(run, x, Step(**common, kv_lookup=kv))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------- fallbacks
def test_steps_not_covered_fall_back(engines, caplog):
    engine = engines("llama")
    sublayers = engine.executor.token_sublayers
    graphs = _host_graphs(engine)
    kv = engine.executor.new_kv_cache(1, 64)
    embeds = (torch.tensor([0]), torch.zeros(1, engine.model.args.hidden_size))
    cases = {
        "prefill": Step.single(0, 5, kv_lookup=kv),
        "several new tokens": Step([0, 1], [3, 4], [2, 1], kv_lookup=kv),
        "multimodal": Step.single(3, 1, kv_lookup=kv, rope_positions=torch.tensor([7])),
        "input_embeds": Step.single(3, 1, kv_lookup=kv, input_embeds=embeds),
        "beyond the largest key bucket": Step.single(64, 1, kv_lookup=kv),
        "more than 64 sequences": Step(list(range(65)), [1] * 65, [1] * 65, kv_lookup=kv),
        "no KV cache": Step.single(3, 1),
    }
    for words, step in cases.items():
        why = graphs.covers(sublayers, step)
        assert why is not None and all(w in why for w in words.split()[:1]), (words, why)
    assert decode_uncovered(Step.single(3, 1)) is None
    with caplog.at_level(logging.INFO, logger="vramshard.runtime.graphs"):
        for _ in range(3):
            assert graphs.run(sublayers, torch.tensor([1, 2, 3, 4, 5]), cases["prefill"]) is None
    assert graphs.stats.fallbacks == {"prefill or several new tokens per sequence": 3}
    assert sum("prefill" in r.message for r in caplog.records) == 1  # said once
    # A sub-layer that is not resident, and a run on the CPU with capture asked for.
    partial = DecodeGraphs({s.name: engine.executor.host[s.name].views for s in sublayers[:-1]}, "cpu",
                           max_context=64, capture=False)
    assert "head is not resident" in partial.covers(sublayers, Step.single(3, 1, kv_lookup=kv))
    capturing = DecodeGraphs({}, "cpu", max_context=64)
    assert "CUDA" in capturing.covers(sublayers, Step.single(3, 1, kv_lookup=kv))


def test_moe_ffn_is_not_covered(engines):
    engine = engines("qwen3_moe")
    graphs = _host_graphs(engine)
    kv = engine.executor.new_kv_cache(1, 64)
    why = graphs.covers(engine.executor.token_sublayers, Step.single(3, 1, kv_lookup=kv))
    assert "MoEFFN" in why


# ---------------------------------------------------------------------------- CUDA graphs
def _gpu_engine(tiny_model_dir, arch, dtype="float32"):
    # KV room for 4 sequences of 64 positions (the paged traces use 4 slots).
    return Engine.load(tiny_model_dir(arch), device="cuda", dtype=dtype, placement="gpu", max_context=64,
                       max_batch=4)


def _gpu_graphs(engine, **kw) -> DecodeGraphs:
    executor = engine.executor
    return DecodeGraphs(executor.resident, executor.gpu, max_context=64,
                        smallest_keys=16, **kw)


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("arch, compile_backend, kernel, dtype", [
    ("llama", None, "sdpa", "float32"), ("qwen3", None, "sdpa", "float32"),
    ("llama", None, "matmul", "float32"),
    ("llama", None, "flash-varlen", "bfloat16"), ("qwen3", None, "flash-varlen", "bfloat16"),
    ("llama", None, "auto", "bfloat16"),
    ("llama", None, "sdpa", "bfloat16"),
    pytest.param("llama", "inductor", "sdpa", "float32",
                 marks=pytest.mark.skipif(not _has_triton(), reason="inductor needs Triton")),
])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_replay_matches_eager_over_16_steps(arch, compile_backend, kernel, dtype, tiny_model_dir, monkeypatch):
    """Also with the fusable parts compiled by inductor, and with each decode attention kernel
    (flash-varlen in bfloat16: the flash kernel has no float32)."""
    from vramshard.layers import static_attention

    monkeypatch.setattr(static_attention, "DECODE_ATTENTION", kernel)
    engine = _gpu_engine(tiny_model_dir, arch, dtype)
    tolerance = 1e-3 if dtype == "float32" else 3e-2
    executor = engine.executor
    graphs = _gpu_graphs(engine, compile_backend=compile_backend)
    prompt = [5, 17, 42, 3, 77, 12, 9, 60, 31, 2, 88, 14]
    ref_kv, kv = executor.new_kv_cache(1, 64), executor.new_kv_cache(1, 64)
    for cache in (ref_kv, kv):
        executor.forward(torch.tensor(prompt), Step.single(0, len(prompt), kv_lookup=cache))
    token = prompt[-1]
    for i in range(16):  # contexts 13 .. 28: key buckets 16 and 32
        step_args = dict(start=len(prompt) + i, length=1)
        expected = executor.forward(torch.tensor([token]), Step.single(**step_args, kv_lookup=ref_kv))
        got = graphs.run(executor.token_sublayers, torch.tensor([token]), Step.single(**step_args, kv_lookup=kv))
        assert got is not None
        torch.testing.assert_close(got.cpu(), expected, rtol=tolerance, atol=tolerance)
        token = int(expected[0].argmax())
    assert graphs.stats.captures == 2 and graphs.stats.replays == 14 and graphs.graphs == 2
    if compile_backend:
        used = [w for (fn, backend), w in graphs_module._compiled.items() if backend == compile_backend]
        assert used and all(w.failed is None for w in used), [w.failed for w in used]
    assert graphs.pool_bytes > 0
    assert graphs.pool_bytes <= torch.cuda.memory_reserved(executor.gpu)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_replay_padded_batch_and_paged_cache(tiny_model_dir):
    engine = _gpu_engine(tiny_model_dir, "llama")
    graphs = _gpu_graphs(engine)

    def run(sublayers, ids, step):
        out = graphs.run(sublayers, ids, step)
        return None if out is None else out.cpu()

    assert _decode_trace(engine, graphs, run=run, cache_tol=1e-3) < 1e-3
    assert graphs.stats.replays > 0 and not graphs.stats.fallbacks
    assert {(b.batch, b.keys) for b in graphs._buckets.values()} >= {(4, 32), (2, 16), (1, 32)}


def test_a_capture_no_larger_than_one_the_pool_held_is_charged_the_pools_growth():
    graphs = DecodeGraphs({}, "cpu", 256, capture=False, pool_limit=64 * 2**20)
    big, small = 60 * 2**20, 40 * 2**20
    assert graphs.charge(big) == big and graphs.fits(big)  # an empty pool: the whole estimate
    graphs._captured(big, 4 * 2**20)  # measured: the capture grew the pool by 4 MiB
    assert graphs.charge(small) == graphs.charge(big) == 4 * 2**20 + SMALL_SEGMENT
    assert graphs.charge(big + 1) == big + 1 and not graphs.fits(big + 1)  # larger than any held: in full
    graphs._captured(big, 0)
    assert graphs.pool_bytes == 4 * 2**20 and graphs.fits(big)
    graphs.pool_limit = graphs.pool_bytes + graphs.charge(big) - 1
    assert not graphs.fits(big)
    graphs.clear()
    assert graphs.pool_bytes == 0 and graphs.charge(small) == small  # a new pool holds nothing


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_memory_limit_and_lru(tiny_model_dir):
    engine = _gpu_engine(tiny_model_dir, "llama")
    executor = engine.executor
    kv = executor.new_kv_cache(1, 64)
    executor.forward(torch.tensor([1, 2, 3]), Step.single(0, 3, kv_lookup=kv))
    first = capture_bytes(executor.token_sublayers, 1, 16, torch.float32)
    limited = _gpu_graphs(engine, pool_limit=first)
    assert limited.run(executor.token_sublayers, torch.tensor([4]), Step.single(3, 1, kv_lookup=kv)) is not None
    assert 0 < limited.pool_bytes <= first  # the estimate covers what the capture took
    # A second bucket (context 20 > 16 keys) of the same estimate reuses the pool: charged the pool's
    # growth so far plus a small segment, it is captured under the same limit.
    assert capture_bytes(executor.token_sublayers, 1, 32, torch.float32) == first
    assert limited.run(executor.token_sublayers, torch.tensor([4]), Step.single(19, 1, kv_lookup=kv)) is not None
    assert limited.pool_bytes <= first and limited.graphs == 2
    # A third where even that charge would pass the limit: not captured, run eagerly.
    limited.pool_limit = limited.pool_bytes + limited.charge(first) - 1
    assert limited.run(executor.token_sublayers, torch.tensor([4]), Step.single(40, 1, kv_lookup=kv)) is None
    assert "the graph memory limit is reached" in limited.stats.fallbacks
    assert _gpu_graphs(engine, pool_limit=first - 1).run(
        executor.token_sublayers, torch.tensor([4]), Step.single(3, 1, kv_lookup=kv)) is None  # not even one
    lru = _gpu_graphs(engine, max_graphs=1)
    for start in (3, 19, 40):
        assert lru.run(executor.token_sublayers, torch.tensor([4]), Step.single(start, 1, kv_lookup=kv)) is not None
    assert lru.graphs == 1 and lru.stats.evictions == 2


@pytest.mark.parametrize("kernel, rows, flash", [("auto", 1, True), ("auto", 16, True), ("auto", 17, False),
                                                 ("flash-varlen", 64, True), ("sdpa", 1, False), ("matmul", 1, False)])
def test_decode_attention_auto_takes_flash_up_to_16_rows(kernel, rows, flash, monkeypatch):
    from vramshard.layers import static_attention

    monkeypatch.setattr(static_attention, "DECODE_ATTENTION", kernel)
    assert static_attention._takes_flash(rows) is flash


def test_flash_lengths_are_made_once_per_step_and_say_each_rows_keys():
    from vramshard.layers.static_attention import DecodeIndex, decode_mask, flash_lengths

    positions = torch.tensor([5, 0, 12])
    cu_q, cu_k, used = flash_lengths(positions, 16)
    assert cu_q.tolist() == [0, 1, 2, 3] and cu_k.tolist() == [0, 16, 32, 48] and used.tolist() == [6, 1, 13]
    assert {t.dtype for t in (cu_q, cu_k, used)} == {torch.int32}
    index = DecodeIndex(positions, positions, positions, torch.zeros(3, 1, dtype=torch.long),
                        decode_mask(positions, torch.arange(16)))
    assert index.flash_lengths is index.flash_lengths  # shared by every layer of the step
    assert index.flash_lengths[1].tolist() == cu_k.tolist()


def test_flash_decode_runs_only_where_the_kernel_does(monkeypatch):
    from vramshard.layers import static_attention

    monkeypatch.setattr(static_attention, "_capability", lambda index: (8, 6))
    gpu = torch.device("cuda", 0)
    assert static_attention.flash_runs(torch.bfloat16, 128, gpu)
    assert not static_attention.flash_runs(torch.float32, 128, gpu)  # no float32 flash kernel
    assert not static_attention.flash_runs(torch.float16, 288, gpu)  # head size beyond the kernel
    assert not static_attention.flash_runs(torch.float16, 100, gpu)
    monkeypatch.setattr(static_attention, "_capability", lambda index: (7, 5))  # a Turing card
    assert not static_attention.flash_runs(torch.float16, 128, gpu)
