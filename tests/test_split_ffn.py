"""Dense FFNs split between the CPU and the GPU inside one layer: the math of pieces, the packed
layout that streams the GPU part, the placement field, the executor (a simulated GPU), the
estimator and the planner."""

import pytest
import torch

from vramshard import Engine
from vramshard.config import ModelArgs
from vramshard.errors import InvalidInputError
from vramshard.layers.mlp import DenseFFN, piece_bounds
from vramshard.plan.memory import split_part_bytes, vram_need
from vramshard.plan.placement import CPU, GPU_RESIDENT, GPU_STREAMED, Placement, TieredPlacement, Where, split_ffn
from vramshard.plan.planner import Planner
from vramshard.plan.tiers import Tiers
from vramshard.profile.query import synthetic
from vramshard.runtime.host_weights import pack_sublayer
from vramshard.runtime import ffn_buffers
from vramshard.runtime.ffn_buffers import FFNBuffers
from vramshard.shapes import shape_model

from placement_helpers import PROMPT, trace_logits

GiB = 2**30


def _ffn(dtype=torch.float32, hidden=48, intermediate=80, pieces=16, seed=0):
    args = ModelArgs("LlamaForCausalLM", "llama", num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=12, vocab_size=96, hidden_size=hidden, intermediate_size=intermediate, rms_norm_eps=1e-6)
    ffn = DenseFFN(args, 0, "model.layers.0", dtype, pieces=pieces)
    g = torch.Generator().manual_seed(seed)
    weights = {spec.source: (torch.randn(spec.shape, generator=g) * 0.2 + (1.0 if len(spec.shape) == 1 else 0))
               .to(dtype) for spec in ffn.weights}
    return ffn, weights


def _whole(ffn, weights):
    return {spec.key: weights[spec.source] for spec in ffn.weights}


# ---------------------------------------------------------------------------- math
def test_piece_bounds_cover_the_intermediate_dimension():
    assert piece_bounds(80, 16) == tuple(5 * p for p in range(17))
    uneven = piece_bounds(14, 4)
    assert uneven[0] == 0 and uneven[-1] == 14 and len(uneven) == 5 and all(b > a for a, b in zip(uneven, uneven[1:]))
    assert piece_bounds(3, 16) == (0, 1, 2, 3)  # never more pieces than rows


@pytest.mark.parametrize("partition", [[(0, 16)], [(0, 7), (7, 16)], [(0, 1), (1, 15), (15, 16)],
                                       [(p, p + 1) for p in range(16)]])
def test_pieces_of_a_partition_add_up_to_the_whole_ffn_float32(partition):
    ffn, weights = _ffn()
    w = _whole(ffn, weights)
    x = torch.randn(5, 48)
    expected = ffn.forward(w, x, None)
    got = x + sum(ffn.forward_pieces(w, x, first, last) for first, last in partition)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # The same from a fused gate_up weight and a once-computed norm.
    fused = dict(w, gate_up_proj=torch.cat([w["gate_proj"], w["up_proj"]]))
    del fused["gate_proj"], fused["up_proj"]
    h = ffn.norm(w, x)
    again = x + sum(ffn.contribution(ffn.pieces_of(fused, a, b), h) for a, b in partition)
    torch.testing.assert_close(again, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_pieces_add_up_within_half_precision_tolerance(dtype):
    ffn, weights = _ffn(dtype)
    w = _whole(ffn, weights)
    x = torch.randn(3, 48).to(dtype)
    expected = ffn.forward(w, x, None).float()
    got = (x + ffn.forward_pieces(w, x, 0, 6) + ffn.forward_pieces(w, x, 6, 16)).float()
    assert (got - expected).abs().max() < 0.02 * expected.abs().max()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_a_cpu_ffn_into_reused_buffers_equals_the_one_with_fresh_tensors(dtype, tol):
    """A dense FFN on the CPU at 40 rows written into the executor's buffers
    (runtime/ffn_buffers.py) is the contribution computed with fresh tensors: split pieces (gate and
    up apart) and the whole FFN (gate and up fused), each again on buffers already used."""
    ffn, weights = _ffn(dtype)
    whole, h = _whole(ffn, weights), torch.randn(40, 48).to(dtype)
    whole["gate_up_proj"] = torch.cat([whole["gate_proj"], whole["up_proj"]])
    buffers = FFNBuffers(pinned=False)
    for first, last in ((0, 7), (3, 12), (0, ffn.num_pieces), (0, 7)):
        part = ffn.pieces_of(whole, first, last) if last < ffn.num_pieces else whole
        work = buffers.work(ffn.work_elements(part, 40), dtype)
        got = ffn.contribution_into(part, h, buffers.result(40, 48, dtype), work).float()
        expected = ffn.contribution(part, h).float()
        # (bf16: the two may take different kernels, chosen by timing in place (layers/cpu_swiglu.py),
        # one rounding the SiLU·up product to bf16 and one not: compared at the output's scale)
        assert (got - expected).abs().max() <= tol * max(expected.abs().max(), 1.0), (first, last)


def test_ffn_buffers_are_reused_grown_and_their_results_alternate():
    buffers = FFNBuffers(pinned=False)
    first, second, third = (buffers.result(32, 64, torch.float32) for _ in range(3))
    assert first.data_ptr() != second.data_ptr() and third.data_ptr() == first.data_ptr()
    work = buffers.work(32 * 96, torch.float32)
    assert work.shape == (32 * 96,) and buffers.work(20 * 96, torch.float32).data_ptr() == work.data_ptr()
    assert buffers.work(64 * 96, torch.float32).numel() == 64 * 96  # grown for a larger step
    assert buffers.result(64, 64, torch.bfloat16).dtype == torch.bfloat16
    # Few-token steps keep the projections tuned per shape (layers/cpu_linear.py).
    assert not FFNBuffers.wanted(1) and not FFNBuffers.wanted(16) and FFNBuffers.wanted(17)



def test_pieces_out_of_range_are_refused():
    ffn, weights = _ffn()
    with pytest.raises(ValueError, match="pieces"):
        ffn.pieces_of(_whole(ffn, weights), 3, 17)


# ---------------------------------------------------------------------------- packing
def test_packed_views_and_split_parts_equal_the_original_weights():
    ffn, weights = _ffn(intermediate=80, pieces=16)
    packed = pack_sublayer(ffn, dict(weights), pin=False)
    for spec in ffn.weights:  # whole-FFN views: the usual shapes, down a transposed view
        assert packed.views[spec.key].shape == spec.shape
        torch.testing.assert_close(packed.views[spec.key], weights[spec.source], rtol=0, atol=0)
    assert not packed.views["down_proj"].is_contiguous()  # stored [F, D]
    torch.testing.assert_close(packed.views["gate_up_proj"],
                               torch.cat([weights[ffn.weights[1].source], weights[ffn.weights[2].source]]))
    assert packed.layout.splittable
    whole = _whole(ffn, weights)
    for first in (1, 5, 15):
        part = packed.layout.split_part(first)
        assert part.nbytes == split_part_bytes_of(ffn, first)
        slot = torch.zeros(part.nbytes + 512, dtype=torch.uint8)
        part.fill(slot, packed.buffer, non_blocking=False)
        views = part.views(slot)
        expected = ffn.pieces_of(whole, first, ffn.num_pieces)
        for key in ("gate_proj", "up_proj", "down_proj"):
            torch.testing.assert_close(views[key], expected[key], rtol=0, atol=0)
        torch.testing.assert_close(views["post_attention_layernorm"], whole["post_attention_layernorm"])
        torch.testing.assert_close(views["gate_up_proj"], torch.cat([expected["gate_proj"], expected["up_proj"]]))
        # The CPU part reads its pieces in place, from the host buffer.
        cpu = ffn.pieces_of(packed.views, 0, first)
        assert cpu["gate_proj"].data_ptr() == packed.views["gate_proj"].data_ptr()
        # Bytes copied: the norm and the part's rows, nothing else.
        assert sum(e - b for b, e, _ in part.copies) == 48 * 4 + ffn.part_bytes(first, 16)
    with pytest.raises(ValueError):
        packed.layout.split_part(16)


def split_part_bytes_of(ffn, first):
    class One:  # a one-sub-layer "model" for memory.split_part_bytes
        def __getitem__(self, name):
            return ffn
    return split_part_bytes(One(), ffn.name, first)


# ---------------------------------------------------------------------------- placement
def test_split_where_round_trips_and_validates():
    where = split_ffn(5)
    assert where == Where("gpu", "stream", cpu_pieces=5) and where.split and str(where) == "cpu:5+gpu+stream"
    assert where.to_list() == ["gpu", "stream", 5] and Where.from_list(["gpu", "stream", 5]) == where
    p = Placement("p", (("embed", CPU), ("ffn[0]", where), ("ffn[1]", GPU_STREAMED), ("head", GPU_RESIDENT)))
    assert Placement.from_json(p.to_json()) == p
    assert p.split_names() == ["ffn[0]"] and "1 FFNs split" in p.summary() and "1 streamed" in p.summary()
    tiered = TieredPlacement((1, 64), (p, p), (None, 2))
    assert TieredPlacement.from_json(tiered.to_json()) == tiered
    for bad in (dict(cpu_pieces=0), dict(cpu_pieces=True), dict(cpu_pieces=2, kv="host")):
        with pytest.raises(InvalidInputError):
            Where("gpu", "stream", **bad)
    with pytest.raises(InvalidInputError):
        Where("gpu", "vram", cpu_pieces=3)
    with pytest.raises(InvalidInputError):
        Where("cpu", "host", cpu_pieces=3)


# ---------------------------------------------------------------------------- executor (simulated GPU)
def _split_placement(model, pieces_on_cpu) -> Placement:
    def where(s):
        if s.kind == "ffn":
            return split_ffn(pieces_on_cpu[s.layer % len(pieces_on_cpu)])
        return CPU if s.kind == "embed" else GPU_STREAMED
    return Placement("split", tuple((s.name, where(s)) for s in model))


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    path = tiny_model_dir("llama")
    reference = Engine.load(path, device="cpu")
    return path, reference, trace_logits(reference)


def test_executor_with_split_ffns_matches_the_cpu_placement(llama):
    path, reference, expected = llama
    placement = _split_placement(reference.model, [3, 15])
    engine = Engine.load(path, placement=placement, simulate_gpu=True, max_context=64)
    executor = engine.executor
    assert executor.placement.split_names() == ["ffn[0]", "ffn[1]"]
    got = trace_logits(engine)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert engine.generate([PROMPT], 8) == reference.generate([PROMPT], 8)
    # Accounting: slots sized for the largest streamed range (an attention or a GPU part), not the FFN.
    model = engine.model
    parts = [split_part_bytes(model, "ffn[0]", 3), split_part_bytes(model, "ffn[1]", 15)]
    largest = max(parts + [executor.host[s.name].layout.nbytes for s in model if s.kind in ("attn", "head")])
    assert executor.need.slots == 2 * largest
    whole = vram_need(model, _split_placement(model, [3, 15]).__class__(
        "stream", tuple((s.name, CPU if s.kind == "embed" else GPU_STREAMED) for s in model)), 1, 64, 2048)
    assert executor.need.slots <= whole.slots


def test_executor_refuses_splits_it_cannot_run(llama):
    path, reference, _ = llama
    with pytest.raises(InvalidInputError, match="pieces"):
        Engine.load(path, placement=_split_placement(reference.model, [16]), simulate_gpu=True, max_context=64)
    bad = Placement("bad", tuple((s.name, split_ffn(2) if s.kind == "attn" else CPU) for s in reference.model))
    with pytest.raises(InvalidInputError, match="dense FFN"):
        Engine.load(path, placement=bad, simulate_gpu=True, max_context=64)


# ---------------------------------------------------------------------------- estimator and planner
def _balanced():
    """CPU GEMV and PCIe about equally fast (CPU a bit faster), a GPU far faster than both."""
    return synthetic(cpu_gflops=2000, cpu_mem_gbps=60, gpu_gflops=200_000, h2d_gbps=50, cpu_threads=16,
                     dispatch_us=5, cpu_contention=1.0, pcie_contention=1.0)


@pytest.fixture(scope="module")
def nemo_plan():
    model = shape_model("nemo-8b")
    planner = Planner(model, _balanced(), 4 * GiB, context=1024, tiers=Tiers((1, 64)))
    return model, planner, planner.plan()


def test_planner_splits_ffns_when_cpu_and_pcie_are_balanced(nemo_plan):
    model, planner, plan = nemo_plan
    decode = plan.tiers[1]
    assert decode.placement.split_names(), decode.candidates
    assert decode.candidates["split"] < decode.candidates["dynamic"]
    assert decode.predicted_s <= decode.candidates["split"]
    assert plan.need.total <= 4 * GiB
    # The executor's own accounting of the tiered placement fits the budget too.
    from vramshard.plan.memory import tiered_vram_need
    need = tiered_vram_need(model, plan.tiered(), 1, 1024, 64)
    assert need.total <= 4 * GiB, need.breakdown()


def test_estimator_ranks_split_above_whole_sub_layer_dynamic(nemo_plan):
    model, planner, plan = nemo_plan
    decode = plan.tiers[1]
    split = planner.estimator.simulate(decode.placements["split"], 1, 1024)
    dynamic = planner.estimator.simulate(decode.placements["dynamic"], 1, 1024)
    assert split.seconds < dynamic.seconds
    # A split streams less than the whole FFNs would and keeps the CPU busier relative to the step.
    whole = Placement("whole", tuple((n, GPU_STREAMED if w.split else w) for n, w in decode.placements["split"].where))
    assert split.bytes_streamed < planner.estimator.simulate(whole, 1, 1024).bytes_streamed


def test_no_split_when_everything_is_resident_or_there_is_no_gpu():
    model = shape_model("nemo-8b")
    resident = Planner(model, _balanced(), 40 * GiB, context=1024, tiers=Tiers((1,))).plan()
    assert not any(p.placement.split_names() for p in resident.tiers.values())
    cpu_only = Planner(model, synthetic(cpu_gflops=1000), 4 * GiB, context=1024, tiers=Tiers((1,))).plan()
    assert not any(p.placement.split_names() for p in cpu_only.tiers.values())
    off = Planner(model, _balanced(), 4 * GiB, context=1024, tiers=Tiers((1,)), split_ffns=False).plan()
    assert not off.tiers[1].placement.split_names() and off.tiers[1].candidates["split"] == float("inf")


def test_engine_lays_ffns_out_in_pieces_only_when_its_plan_splits_them(llama):
    """The split layout stores down_proj transposed; an engine whose plan splits nothing keeps the
    checkpoint's layout, and later plans (a changed budget) are told not to split."""
    path, reference, expected = llama
    plain = Engine.load(path, placement="stream", simulate_gpu=True, vram="1GiB", max_context=64)
    dense = [s.name for s in plain.model if isinstance(s, DenseFFN)]
    assert not any(plain.executor.host[n].layout.splittable for n in dense)
    assert plain.budget.settings.split_ffns is False
    torch.testing.assert_close(trace_logits(plain), expected, rtol=1e-5, atol=1e-5)
    split = Engine.load(path, placement=_split_placement(reference.model, [3, 15]), simulate_gpu=True,
                        vram="1GiB", max_context=64)
    assert all(split.executor.host[n].layout.splittable for n in dense)
    assert split.budget.settings.split_ffns is True


def test_host_layouts_give_each_placement_its_layout(llama):
    from vramshard.runtime.host_weights import HostLayouts, pack_model, splits_ffns
    from vramshard.runtime.weights import load_weights
    from vramshard.loading.checkpoint import open_checkpoint

    path, reference, expected = llama
    model = reference.model
    host = pack_model(list(model), load_weights(model, open_checkpoint(path)), pin=False, splittable=False)
    layouts = HostLayouts(model, host, pin=False)
    split = _split_placement(model, [3, 15])
    assert layouts.for_placement(Placement("cpu", tuple((s.name, CPU) for s in model))) is host
    assert splits_ffns(list(model), layouts.for_placement(split)) and splits_ffns(list(model), layouts.for_placement(None))
    attn = [s.name for s in model if s.kind == "attn"]
    assert all(layouts.split[n] is host[n] for n in attn)  # only dense FFNs are copied
    for name in ("ffn[0]", "ffn[1]"):
        for key, view in host[name].views.items():
            assert torch.equal(layouts.split[name].views[key], view), (name, key)


LONG_PROMPT = [(7 * i + 3) % 90 for i in range(40)]  # rows above cpu_linear.MAX_TOKENS


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 3e-2)])
def test_an_engine_on_the_cpu_computes_the_same_logits_with_and_without_ffn_buffers(tiny_model_dir, monkeypatch,
                                                                                   dtype, tol):
    """Every FFN of a CPU engine at 40 prompt rows runs in the reused buffers (two result buffers
    alternating over the layers); the logits are those of fresh tensors (VRAMSHARD_FFN_BUFFERS=off)."""
    path = tiny_model_dir("llama")
    engine = Engine.load(path, device="cpu", dtype=dtype)
    with_buffers = trace_logits(engine, prompt=LONG_PROMPT)
    assert engine.executor._ffn_buffers._work is not None
    monkeypatch.setattr(ffn_buffers, "ENABLED", False)
    fresh = Engine.load(path, device="cpu", dtype=dtype)
    torch.testing.assert_close(with_buffers.float(), trace_logits(fresh, prompt=LONG_PROMPT).float(), rtol=tol, atol=tol)
    assert fresh.executor._ffn_buffers._work is None
