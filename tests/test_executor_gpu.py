"""Every placement computes what the all-CPU placement computes (needs CUDA)."""

import gc
import threading
import weakref

import pytest
import torch

from tiny_models import ARCHS
from vramshard import Engine
from vramshard.errors import BudgetError
from vramshard.plan.memory import ALLOCATOR_SLACK
from vramshard.plan.placement import CPU, GPU_RESIDENT, GPU_STREAMED, Placement

from placement_helpers import FORCED, PROMPT, trace_logits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PLACEMENTS = ["gpu", "layers:1", "stream", "static", "mixed"]


def mixed(engine_cpu) -> Placement:
    """A hand-made mix of all three homes, alternating per sub-layer."""
    homes = [GPU_STREAMED, CPU, GPU_RESIDENT]
    return Placement("mixed", tuple((s.name, homes[i % 3]) for i, s in enumerate(engine_cpu.model)))


@pytest.fixture(scope="module")
def cpu_reference():
    cache = {}

    def get(path, dtype):
        key = (str(path), dtype)
        if key not in cache:
            engine = Engine.load(path, device="cpu", dtype=dtype)
            cache[key] = (engine, trace_logits(engine))
        return cache[key]

    return get


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_placement_matches_cpu_float32(arch, placement, tiny_model_dir, cpu_reference):
    path = tiny_model_dir(arch)
    cpu_engine, expected = cpu_reference(path, "float32")
    spec = mixed(cpu_engine) if placement == "mixed" else placement
    engine = Engine.load(path, device="cuda", dtype="float32", placement=spec, max_context=64)
    got = trace_logits(engine)
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)
    # Greedy continuation too (exercises the engine's own prefill and decode loop).
    assert engine.generate([PROMPT], 16) == cpu_engine.generate([PROMPT], 16)


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_placement_bf16_within_dtype_tolerance(arch, placement, tiny_model_dir, cpu_reference):
    path = tiny_model_dir(arch)
    cpu_engine, expected = cpu_reference(path, "float32")
    spec = mixed(cpu_engine) if placement == "mixed" else placement
    engine = Engine.load(path, device="cuda", dtype="bfloat16", placement=spec, max_context=64)
    got = trace_logits(engine)
    scale = expected.abs().max()
    assert (got - expected).abs().max() < 0.05 * scale


def test_streaming_reuses_ring_across_steps(tiny_model_dir):
    engine = Engine.load(tiny_model_dir("llama"), device="cuda", dtype="float32", placement="stream",
                         num_slots=2, max_context=64)
    trace_logits(engine)
    streamed = len(engine.executor.placement.names(home="stream"))
    assert streamed == len(engine.model) - 1  # all but the embedding
    # Every step moves every streamed sub-layer once.
    per_step = sum(engine.executor.host[n].layout.nbytes for n in engine.executor.placement.names(home="stream"))
    assert engine.executor.report.bytes_streamed == per_step


def test_budget_is_enforced_and_peak_reported(tiny_model_dir):
    path = tiny_model_dir("llama")
    with pytest.raises(BudgetError, match="needs"):
        Engine.load(path, device="cuda", placement="gpu", vram="1MiB")
    budget = 200 * 2**20
    engine = Engine.load(path, device="cuda", placement="stream", vram=budget, max_context=64)
    trace_logits(engine)
    assert 0 < engine.executor.peak_vram() <= budget


@pytest.mark.parametrize("placement", ["gpu", "layers:1"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_decode_graphs_match_cpu_float32(arch, placement, tiny_model_dir, cpu_reference):
    """Decode steps replayed from CUDA graphs compute what the CPU computes, greedy tokens too."""
    path = tiny_model_dir(arch)
    cpu_engine, expected = cpu_reference(path, "float32")
    engine = Engine.load(path, device="cuda", dtype="float32", placement=placement, max_context=64,
                         decode_graphs=True)
    got = trace_logits(engine)
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)
    assert engine.generate([PROMPT], 16) == cpu_engine.generate([PROMPT], 16)
    graphs = engine.executor.graphs
    assert graphs is not None and graphs.stats.replays > 0, graphs.stats if graphs else "no graphs"
    assert engine.executor.peak_vram() > 0


def _blocks(name: str, model, attention, ffn) -> Placement:
    """Embedding on the CPU, head resident, attention and FFN where ``attention(s)`` / ``ffn(s)`` say."""
    fixed = {"embed": CPU, "head": GPU_RESIDENT}
    return Placement(name, tuple((s.name, fixed.get(s.kind) or (attention(s) if s.kind == "attn" else ffn(s)))
                                 for s in model))


# ---------------------------------------------------------------------------- attention over a host KV cache
def _host_kv_tiers(model):
    """KV caches in host memory. Decode (tier 1): attention on the CPU, except attn[0], resident and
    run on the GPU over its host KV cache in every tier; prompt chunks (tier 64): every attention on
    the GPU over its host KV cache, staged through VRAM. FFNs stream, the head is resident."""
    from vramshard.plan.placement import GPU_RESIDENT_HOST_KV, GPU_STREAMED_HOST_KV, TieredPlacement

    def place(prompt: bool) -> Placement:
        def attention(s):
            if s.layer == 0:
                return GPU_RESIDENT_HOST_KV
            return GPU_STREAMED_HOST_KV if prompt else CPU
        return _blocks("prompt" if prompt else "decode", model, attention, lambda s: GPU_STREAMED)

    return TieredPlacement((1, 64), (place(False), place(True)), (None, None))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gpu_attention_over_host_kv_matches_cpu_float32(arch, tiny_model_dir, cpu_reference):
    """Prompt chunks compute attention on the GPU over the host KV cache, decode steps on the CPU:
    same logits and greedy tokens as the CPU reference, KV never in VRAM, peak VRAM within budget."""
    path = tiny_model_dir(arch)
    cpu_engine, expected = cpu_reference(path, "float32")
    budget = 200 * 2**20
    engine = Engine.load(path, device="cuda", dtype="float32", placement="stream", vram=budget, max_context=64)
    engine.executor.reconfigure(_host_kv_tiers(engine.model), budget)
    executor = engine.executor
    assert executor.kv_layers_on_gpu == set() and executor.need.kv == 0 and executor.need.kv_staging > 0
    got = trace_logits(engine, prefill_chunk=5)  # chunks of 5, 5, 2: later chunks copy their prefix in
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)
    assert engine.generate([PROMPT], 16) == cpu_engine.generate([PROMPT], 16)
    # A batch of two (paged KV blocks of two sequences) and a second round over the same caches.
    prompts = [PROMPT, FORCED[:7]]
    assert engine.generate(prompts, 8) == cpu_engine.generate(prompts, 8)
    assert 0 < executor.peak_vram() <= budget, (executor.peak_vram(), executor.need.breakdown())


def test_gpu_attention_over_host_kv_reports_staging_copies(tiny_model_dir):
    from vramshard.layers.step import Step

    engine = Engine.load(tiny_model_dir("llama"), device="cuda", dtype="float32", placement="stream", max_context=64)
    engine.executor.reconfigure(_host_kv_tiers(engine.model), None)
    executor = engine.executor
    kv = executor.new_kv_cache(slots=1, max_ctx=32)
    assert all(kv.device_of(layer).type == "cpu" for layer in kv.layers)
    executor.forward(torch.tensor(PROMPT[:8]), Step.single(0, 8, kv_lookup=kv))
    first = dict(executor.report.extra)
    executor.forward(torch.tensor(PROMPT[8:]), Step.single(8, 4, kv_lookup=kv))
    later = dict(executor.report.extra)
    layers = len(kv.layers)
    per_token = 2 * engine.model.args.num_key_value_heads * engine.model.args.head_dim * 4
    assert first.get("kv_staged_in", 0) == 0 and first["kv_written_back"] == layers * 8 * per_token
    assert later["kv_staged_in"] == layers * 16 * per_token  # the prefix: one block of 16 positions per layer
    assert later["kv_written_back"] == layers * 4 * per_token


def test_gpu_attention_over_a_page_locked_host_kv_is_copied_in_place(tiny_model_dir, cpu_reference, monkeypatch):
    """An executor that stages attention allocates its host KV caches page-locked, and the staging copies their
    prefixes in place (no gather) where the runs of blocks are long: the same logits as the CPU reference over a
    250-token prompt in chunks (prefixes of 64-192 positions, one run each; runs of 4 blocks taken as long here)."""
    from vramshard.runtime import kv_staging

    monkeypatch.setattr(kv_staging, "DIRECT_RUN_BLOCKS", 4)
    path = tiny_model_dir("llama")
    cpu_engine, _ = cpu_reference(path, "float32")
    engine = Engine.load(path, device="cuda", dtype="float32", placement="stream", max_context=256)
    engine.executor.reconfigure(_host_kv_tiers(engine.model), None)
    in_place = []
    real = kv_staging.KVStaging._copy_in_place
    monkeypatch.setattr(kv_staging.KVStaging, "_copy_in_place",
                        lambda self, plan, host: in_place.append(host.k.is_pinned()) or real(self, plan, host))
    ids = torch.randint(0, engine.model.args.vocab_size, (250,), generator=torch.Generator().manual_seed(7)).tolist()
    got = engine.logits(ids)
    assert in_place and all(in_place)
    torch.testing.assert_close(got, cpu_engine.logits(ids), rtol=1e-3, atol=1e-3)


# ---------------------------------------------------------------------------- dense FFNs split CPU / GPU
def _split_ffn_placement(model) -> Placement:
    """FFNs split between the CPU and a stream slot; attention alternately on the CPU (the split's
    input then on the host) and streamed to the GPU (input on the GPU), so both split paths run."""
    from vramshard.plan.placement import split_ffn

    return _blocks("split", model, lambda s: CPU if s.layer % 2 == 0 else GPU_STREAMED,
                   lambda s: split_ffn(3 + 9 * (s.layer % 2)))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_split_ffn_placement_matches_cpu_float32(arch, tiny_model_dir, cpu_reference):
    """Split FFNs (GPU part streamed, CPU part from host memory, added where the input lives) compute
    the CPU reference's logits and greedy tokens; the ring streams only the GPU parts; peak VRAM
    stays within the budget. The model is float32: its CPU parts' down projections are copied
    row-major as half-precision ones are (the copy does not depend on the dtype)."""
    path = tiny_model_dir(arch)
    cpu_engine, expected = cpu_reference(path, "float32")
    budget = 200 * 2**20
    engine = Engine.load(path, device="cuda", dtype="float32", placement=_split_ffn_placement(cpu_engine.model),
                         vram=budget, max_context=64)
    executor = engine.executor
    assert executor.placement.split_names()
    got = trace_logits(engine)
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)
    assert engine.generate([PROMPT], 16) == cpu_engine.generate([PROMPT], 16)
    # One decode step streams the streamed attentions whole and the split FFNs' GPU parts only.
    host = executor.host
    per_step = sum(host[n].layout.nbytes for n in executor.placement.names(home="stream")
                   if not executor.placement[n].split)
    per_step += sum(sum(e - b for b, e, _ in host[n].layout.split_part(executor.placement[n].cpu_pieces).copies)
                    for n in executor.placement.split_names())
    assert executor.report.bytes_streamed == per_step
    assert executor.report.crossings >= 2 * len(executor.placement.split_names())
    assert 0 < executor.peak_vram() <= budget, (executor.peak_vram(), executor.need.breakdown())
    # The prompt's CPU parts read weights prepacked for oneDNN where the plan packs at its tier
    # (runtime/cpu_packed.py: beside a GPU, at the tiers where the profile finds packing pays), else
    # row-major copies of their down projections (runtime/cpu_down.py; auto by default); never both.
    if executor._packed.enabled and executor._packed.packs_rows(len(PROMPT)):
        assert executor._packed.nbytes > 0 and executor._down_copies.nbytes == 0
    elif executor._down_copies.mode != "off":
        assert executor._down_copies.nbytes > 0 and executor._packed.nbytes == 0


LONG_PROMPT = [(7 * i + 3) % 97 for i in range(40)]  # rows above cpu_linear.MAX_TOKENS


def _split_engine_matching_cpu_at_many_rows(tiny_model_dir, cpu_reference):
    """The tiny llama model on the split placement: prefills of LONG_PROMPT in chunks of 20 and 40
    rows, each followed by one-row decodes, compute the CPU reference's logits. (engine, those logits)."""
    path = tiny_model_dir("llama")
    cpu_engine, _ = cpu_reference(path, "float32")
    expected = trace_logits(cpu_engine, prompt=LONG_PROMPT)
    engine = Engine.load(path, device="cuda", dtype="float32", placement=_split_ffn_placement(cpu_engine.model),
                         vram=200 * 2**20, max_context=64)
    for chunk in (20, None):
        got = trace_logits(engine, prompt=LONG_PROMPT, prefill_chunk=chunk)
        torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)
    return engine, expected


@pytest.mark.parametrize("packed", ["on", "off"])
def test_split_ffn_cpu_parts_at_many_rows_reuse_their_buffers_and_match_cpu_float32(tiny_model_dir, cpu_reference,
                                                                                    monkeypatch, packed):
    """A split FFN's CPU part at 40 rows writes into the executor's reused buffers (its result in
    pinned memory, copied to the GPU while the next layer's CPU part overwrites the other one; from
    plain weights its gate and up products in the work buffer too): two prefills in chunks of 20 and
    40 rows and the decode after them compute the CPU reference's logits, prepacked or not."""
    from vramshard.runtime import cpu_packed

    monkeypatch.setattr(cpu_packed, "MODE", packed)
    engine, _ = _split_engine_matching_cpu_at_many_rows(tiny_model_dir, cpu_reference)
    buffers = engine.executor._ffn_buffers
    assert engine.executor._packed.enabled is (packed == "on")
    assert all(r is not None and r.is_pinned() for r in buffers._results)
    assert (buffers._work is not None) is (packed == "off")


def test_run_ahead_split_steps_match_cpu_float32_and_a_failed_cpu_part_fails_its_step(tiny_model_dir, cpu_reference,
                                                                                       monkeypatch):
    """VRAMSHARD_RUN_AHEAD (runtime/run_ahead.py): split FFNs' CPU parts on the worker while the
    GPU waits in its kernel. Prompt chunks of 20 and 40 rows (the buffers) and one-row decodes
    (the tuned projections) compute the CPU reference's logits; a CPU part that raises fails its
    step with that error, and the next step runs."""
    from vramshard.layers.mlp import DenseFFN
    from vramshard.runtime import run_ahead

    monkeypatch.setattr(run_ahead, "ENABLED", True)
    monkeypatch.setattr(run_ahead, "DENSE", True)
    engine, expected = _split_engine_matching_cpu_at_many_rows(tiny_model_dir, cpu_reference)
    ahead = engine.executor._run_ahead
    assert ahead is not None and ahead._issued > 0 and engine.executor.report.host_compute_s > 0

    from vramshard.runtime.cpu_packed import PackedPart

    # The worker computes a part from plain weights or from prepacked ones (the default beside a GPU).
    computing = [(DenseFFN, "contribution_into"), (DenseFFN, "contribution"), (PackedPart, "contribution")]
    real = {(owner, name): getattr(owner, name) for owner, name in computing}

    def broken(owner, name):
        def fails(*args, **kwargs):  # on the worker only: the CPU-input layers compute theirs on the host thread
            if threading.current_thread().name == "vramshard-cpu-parts":
                raise ValueError("a CPU part that fails")
            return real[owner, name](*args, **kwargs)
        return fails

    for owner, name in computing:
        monkeypatch.setattr(owner, name, broken(owner, name))
    with pytest.raises(RuntimeError, match="a CPU part that fails"):
        trace_logits(engine, prompt=LONG_PROMPT)
    for owner, name in computing:
        monkeypatch.setattr(owner, name, real[owner, name])
    torch.testing.assert_close(trace_logits(engine, prompt=LONG_PROMPT), expected, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("ahead", [False, True])
def test_split_ffn_one_row_parts_by_the_c_kernel_match_cpu_float32(tiny_model_dir, cpu_reference, monkeypatch, ahead):
    """bf16 split FFNs whose one-row CPU parts run through the C kernel (layers/cpu_gemv.py, on by default
    beside a GPU), on the host thread or the run-ahead worker: the CPU float32 reference's logits within
    bf16's rounding, and neither a prepacked copy nor a row-major down copy made for a decode step."""
    from vramshard.layers import cpu_gemv
    from vramshard.layers.step import Step
    from vramshard.runtime import run_ahead

    if cpu_gemv.library() is None:
        # (without a C compiler the kernel serves nowhere here; with one, a failed build is a failure)
        assert cpu_gemv._compiler() is None, f"the C kernel does not build here: {cpu_gemv.failure()}"
        pytest.skip("no C compiler here: the kernel serves nowhere on this machine")
    monkeypatch.setenv("VRAMSHARD_CPU_GEMV", "on")
    monkeypatch.setattr(run_ahead, "ENABLED", ahead)
    monkeypatch.setattr(run_ahead, "DENSE", ahead)
    path = tiny_model_dir("llama")
    cpu_engine, _ = cpu_reference(path, "float32")
    expected = trace_logits(cpu_engine)
    threads = []  # the thread of each part the kernel computed: by swiglu, or the worker's bound call (session 61)
    real, bound_run = cpu_gemv.swiglu, cpu_gemv.BoundPart.run
    monkeypatch.setattr(cpu_gemv, "swiglu", lambda *a: threads.append(threading.current_thread().name) or real(*a))

    def run(self, *args):
        status, waited = bound_run(self, *args)
        if status == 0:  # (computed: not a wait that timed out)
            threads.append(threading.current_thread().name)
        return status, waited

    monkeypatch.setattr(cpu_gemv.BoundPart, "run", run)
    engine = Engine.load(path, device="cuda", dtype="bfloat16", placement=_split_ffn_placement(cpu_engine.model),
                         vram=200 * 2**20, max_context=64)
    executor = engine.executor
    kv = executor.new_kv_cache(slots=1, max_ctx=len(PROMPT) + len(FORCED))
    rows = [executor.forward(torch.tensor(PROMPT), Step.single(0, len(PROMPT), all_logits=True, kv_lookup=kv))]
    prompt_copies = (set(executor._packed._parts), executor._down_copies.nbytes)  # (the prompt's own)
    threads.clear()
    for i, token in enumerate(FORCED):
        rows.append(executor.forward(torch.tensor([token]), Step.single(len(PROMPT) + i, 1, kv_lookup=kv)))
    got = torch.cat(rows)
    torch.testing.assert_close(got.float(), expected, rtol=0, atol=0.06 * expected.abs().max().item())
    assert len(threads) >= len(FORCED) * len(executor.placement.split_names())
    assert ("vramshard-cpu-parts" in threads) is ahead
    assert (set(executor._packed._parts), executor._down_copies.nbytes) == prompt_copies  # (none for decoding)


def test_engines_made_one_after_another_leave_no_vram_behind(tiny_model_dir):
    """Each executor's matmuls used to run on a stream of its own, and cuBLAS keeps a workspace
    per stream for the life of the process: 32 MiB left reserved per executor (0.5 GiB after 16
    in one moe_bench run). Executors share the process's streams now: after the first engine,
    more engines made, run and dropped leave less than one workspace behind."""

    path = tiny_model_dir("llama")

    def reserved_after_an_engine() -> int:
        engine = Engine.load(path, device="cuda", dtype="bfloat16", placement="gpu", max_context=64)
        engine.generate([PROMPT], 4)
        del engine
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved()

    first = reserved_after_an_engine()
    later = [reserved_after_an_engine() for _ in range(4)]
    assert max(later) - first < 32 * 2**20, [first, *later]


@pytest.mark.parametrize("keep", [True, False])
def test_a_switch_that_keeps_the_resident_set_keeps_its_weights_and_graphs_in_vram(tiny_model_dir, cpu_reference,
                                                                                  monkeypatch, keep):
    """VRAMSHARD_KEEP_RESIDENT: a re-plan pinning and unpinning nothing (25 of 42 switches in two GPU sessions)
    keeps the resident buffer and the decode graphs over it; one that moves the resident set loads afresh;
    either way the tokens are the CPU reference's."""
    from vramshard.runtime import executor as executor_module

    monkeypatch.setattr(executor_module, "KEEP_RESIDENT", keep)
    path = tiny_model_dir("llama")
    cpu_engine, _ = cpu_reference(path, "float32")
    expected = cpu_engine.generate([PROMPT], 12)
    sublayers = list(cpu_engine.model)

    def placement(name, others):  # the first two sub-layers resident, the rest as ``others``
        return Placement(name, tuple((s.name, GPU_RESIDENT if i < 2 else others) for i, s in enumerate(sublayers)))

    engine = Engine.load(path, device="cuda", dtype="float32", placement=placement("a", GPU_STREAMED),
                         max_context=64)
    executor = engine.executor
    assert engine.generate([PROMPT], 12) == expected
    buffer, graphs = executor._resident_buffer, executor.graphs
    assert graphs is not None
    executor.reconfigure(placement("b", CPU), executor.budget)  # the same two resident, the rest on the CPU
    assert (executor._resident_buffer is buffer and executor.graphs is graphs) == keep
    assert engine.generate([PROMPT], 12) == expected
    moved = Placement("c", tuple((s.name, GPU_RESIDENT if i in (0, 2) else CPU) for i, s in enumerate(sublayers)))
    executor.reconfigure(moved, executor.budget)
    assert executor._resident_buffer is not buffer and executor.graphs is not graphs
    assert engine.generate([PROMPT], 12) == expected


def test_a_switch_collects_garbage_only_where_a_dropped_buffer_is_still_held(tiny_model_dir, cpu_reference):
    """A switch runs ``gc.collect`` (about 0.1 s in a process holding a model) only where a buffer it dropped is
    still held, as by a reference cycle: not because another engine of the process holds VRAM (with two engines
    loaded, the first one's every switch collected: 137-243 ms in the forty-fifth GPU session's paired_decode
    run). Either way the VRAM the switch dropped is given back and the tokens are the CPU reference's."""
    path = tiny_model_dir("llama")
    cpu_engine, _ = cpu_reference(path, "float32")
    expected = cpu_engine.generate([PROMPT], 12)
    sublayers = list(cpu_engine.model)

    def placement(name, first, others):  # the first sub-layer as ``first``, the rest as ``others``
        return Placement(name, tuple((s.name, first if i == 0 else others) for i, s in enumerate(sublayers)))

    engine = Engine.load(path, device="cuda", dtype="float32", placement=placement("a", GPU_RESIDENT, GPU_STREAMED),
                         max_context=64)
    other = Engine.load(path, device="cuda", dtype="float32", placement="gpu", max_context=64)  # loaded after it
    # The tiny engine holds a few MiB; what a model's other engine holds passes the allocator's slack, so the
    # process's VRAM alone would call for a collection at every switch (as it did before the buffers were asked).
    others_vram = torch.empty(2 * ALLOCATOR_SLACK, dtype=torch.uint8, device="cuda")
    executor = engine.executor
    assert torch.cuda.memory_reserved() - executor._vram_before > 2 * ALLOCATOR_SLACK
    assert engine.generate([PROMPT], 12) == expected and other.generate([PROMPT], 12) == expected
    report = executor.reconfigure(placement("b", GPU_STREAMED, GPU_STREAMED), executor.budget)
    assert "collect" not in report.release_parts
    assert engine.generate([PROMPT], 12) == expected
    ring = weakref.ref(executor.ring)
    cycle: list = [executor.ring]
    cycle.append(cycle)  # only the collector frees the ring now
    del cycle
    gc.disable()
    try:
        report = executor.reconfigure(placement("c", GPU_RESIDENT, CPU), executor.budget)
    finally:
        gc.enable()
    assert "collect" in report.release_parts and ring() is None
    assert engine.generate([PROMPT], 12) == expected and other.generate([PROMPT], 12) == expected
    del others_vram
