"""Pinned weights kept coded in VRAM (runtime/vram_coded, Where.coded): the placement's data, the coded
buffer's decode, the VRAM accounting, the estimator's and the planner's prices, and (GPU) the engine's
logits with coded pins equal to those with raw pins, bit for bit."""

import pytest
import torch

from vramshard.errors import InvalidInputError
from vramshard.plan.estimator import Estimator, vram_decode_bps
from vramshard.plan.mechanisms import Mechanisms, fixed_mechanisms
from vramshard.plan.memory import sublayer_packed_bytes, vram_need
from vramshard.plan.placement import CPU, GPU_CODED, GPU_RESIDENT, GPU_STREAMED, Placement, Where
from vramshard.plan.planner import Planner
from vramshard.plan.tiers import Tiers
from vramshard.profile.query import synthetic
from vramshard.runtime import budget as budgets
from vramshard.runtime import plan_wire, vram_coded
from vramshard.runtime.vram_coded import CodingError, VramCoded
from vramshard.runtime.wire_codec import BLOCK, BLOCK_BYTES, CODED_BLOCK, ESCAPES, STAGING_BYTES
from vramshard.models import build_model
from vramshard.shapes import shape_config, shape_model

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# A client machine's link and CPU beside a GPU whose memory decodes quickly.
PROFILE = synthetic(cpu_gflops=1500, gpu_gflops=200_000, h2d_gbps=25, cpu_mem_gbps=60, gpu_mem_gbps=1500)


def _mechanisms(vram_codec: bool) -> Mechanisms:
    return Mechanisms(False, False, False, (False, 0), False, False, vram_codec)


def _weights(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16).view(torch.uint8)


def test_a_coded_pin_is_plain_data_and_only_for_pinned_weights():
    for where in (GPU_CODED, Where("gpu", "vram", kv="host", coded=True)):
        assert Where.from_list(where.to_list()) == where
        assert "coded" in str(where)
    placement = Placement("p", (("attn[0]", GPU_CODED), ("ffn[0]", GPU_RESIDENT), ("head", CPU)))
    assert Placement.from_json(placement.to_json()) == placement
    assert placement.coded_names() == ["attn[0]"]
    for compute, home in (("gpu", "stream"), ("cpu", "host")):
        with pytest.raises(InvalidInputError, match="coded"):
            Where(compute, home, coded=True)
    with pytest.raises(InvalidInputError, match="coded"):
        Where.from_list(["gpu", "vram", "coded", "kv@host"])


def test_a_coded_buffer_decodes_its_bytes_with_a_ragged_end_and_overflowed_blocks():
    raw = _weights(BLOCK * 150 + 19)  # 150 blocks and a ragged end
    words = raw[: BLOCK * 300].view(torch.int16)
    # Block 3 takes too many exponents for its escapes: it is kept raw beside the coded ones.
    words[3 * BLOCK : 3 * BLOCK + 15 + ESCAPES + 5] = ((torch.arange(15 + ESCAPES + 5, dtype=torch.int16) + 1) << 7)
    coded = VramCoded(raw, "cpu")
    assert coded.blocks == raw.numel() // BLOCK_BYTES and coded.tail == raw.numel() % BLOCK_BYTES
    assert coded.overflow.tolist() == [3]
    assert coded.vram_bytes == coded.blocks * CODED_BLOCK + coded.tail + BLOCK_BYTES
    assert coded.vram_bytes <= vram_coded.vram_bytes(raw.numel())
    target = torch.full((raw.numel(),), 0xAB, dtype=torch.uint8)
    coded.decode(target)
    assert torch.equal(target, raw)


def test_a_coded_host_copy_is_copied_in_not_coded_again(monkeypatch):
    """Where the link codec has coded the host buffer already, the coded pin takes its blocks and overflowed
    blocks from there (a plan switch then copies, not codes); a host copy of other bytes is not used."""
    from vramshard.runtime.wire_codec import CodedBuffer

    raw = _weights(BLOCK * 150 + 19, seed=3)
    words = raw[: BLOCK * 300].view(torch.int16)
    words[5 * BLOCK : 5 * BLOCK + 15 + ESCAPES + 5] = ((torch.arange(15 + ESCAPES + 5, dtype=torch.int16) + 1) << 7)
    host = CodedBuffer(raw)
    fresh = VramCoded(raw, "cpu")
    assert not fresh.copied
    monkeypatch.setattr(vram_coded, "code_blocks", lambda *a, **k: pytest.fail("coded again"))
    copied = VramCoded(raw, "cpu", host)
    assert copied.copied and copied.overflow.tolist() == [5]
    assert torch.equal(copied.buffer, fresh.buffer) and torch.equal(copied.patches, fresh.patches)
    target = torch.zeros_like(raw)
    copied.decode(target)
    assert torch.equal(target, raw)
    with pytest.raises(pytest.fail.Exception, match="coded again"):  # (another buffer's copy: coded anew)
        VramCoded(raw.clone(), "cpu", host)


def test_bytes_that_are_not_bf16_weights_are_not_coded():
    noise = torch.randint(0, 256, (BLOCK_BYTES * 200,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    with pytest.raises(CodingError, match="overflowed"):
        VramCoded(noise, "cpu")


def test_the_switch_and_the_dtype_decide_what_may_be_coded(monkeypatch):
    monkeypatch.setenv("VRAMSHARD_VRAM_CODEC", "on")
    assert vram_coded.codes(torch.bfloat16) and not vram_coded.codes(torch.float16)
    monkeypatch.setenv("VRAMSHARD_VRAM_CODEC", "off")
    assert not vram_coded.codes(torch.bfloat16)


def _llama_placement(model, coded: bool) -> Placement:
    """Layer 0 pinned (coded or raw), the rest streamed, the embedding on the CPU, the head on the GPU."""
    def where(s):
        if s.kind == "embed":
            return CPU
        if s.kind == "head":
            return GPU_RESIDENT
        if s.layer == 0:
            return GPU_CODED if coded else GPU_RESIDENT
        return GPU_STREAMED
    return Placement("coded" if coded else "raw", tuple((s.name, where(s)) for s in model))


def test_coded_pins_take_their_coded_bytes_and_a_slot():
    model = shape_model("llama3-8b", torch.bfloat16)
    raw, coded = (vram_need(model, _llama_placement(model, c), 1, 1024, 16, wire_coded=False) for c in (False, True))
    layer0 = sum(sublayer_packed_bytes(model, n) for n in ("attn[0]", "ffn[0]"))
    head = sublayer_packed_bytes(model, "head")
    assert raw.resident == layer0 + head
    assert coded.resident == head + sum(vram_coded.vram_bytes(sublayer_packed_bytes(model, n))
                                        for n in ("attn[0]", "ffn[0]"))
    assert 0.75 * layer0 < coded.resident - head < 0.77 * layer0
    assert coded.slots == raw.slots  # (the streamed FFNs size the slots already)
    # Alone (nothing streamed), the coded pins still need the ring's slots.
    alone = Placement("alone", tuple((n, CPU if w == GPU_STREAMED or n == "head" else w)
                                     for n, w in _llama_placement(model, True).where))
    assert vram_need(model, alone, 1, 1024, 16, wire_coded=False).slots == 2 * sublayer_packed_bytes(model, "ffn[0]")
    # With the link coded, the ring's staging too (the executor's ring has it).
    assert vram_need(model, alone, 1, 1024, 16, wire_coded=True).slots \
        == 2 * sublayer_packed_bytes(model, "ffn[0]") + STAGING_BYTES


def test_the_estimator_decodes_coded_pins_beside_the_link():
    """A coded pin costs its decode on its own stream, not the link: the step with layer 0 coded is priced
    near the raw one, far under layer 0 streamed, and moves no more bytes over the link. The decodes share the
    GPU's memory with the compute kernels: its busy time is theirs and the decodes' together."""
    model = shape_model("llama3-8b", torch.bfloat16)
    est = Estimator(model, PROFILE)
    raw, coded = (est.simulate(_llama_placement(model, c), 1, 1024) for c in (False, True))
    streamed = Placement("s", tuple((n, GPU_STREAMED if w == GPU_RESIDENT and n != "head" else w)
                                    for n, w in _llama_placement(model, False).where))
    all_streamed = est.simulate(streamed, 1, 1024)
    assert coded.bytes_streamed == raw.bytes_streamed < all_streamed.bytes_streamed
    decodes = [e for e in coded.timeline if e[1] == "decode"]
    assert {e[0] for e in decodes} == {"attn[0]", "ffn[0]"}
    ffn = model["ffn[0]"]
    assert est.decode_s(ffn) == pytest.approx(sublayer_packed_bytes(model, "ffn[0]") / vram_decode_bps(PROFILE))
    decoding = est.decode_s(ffn) + est.decode_s(model["attn[0]"])
    assert coded.gpu_busy == pytest.approx(raw.gpu_busy + decoding)
    # (held in the GPU's order, the decodes release their slots later: the copies behind them start later too)
    assert raw.seconds < coded.seconds < raw.seconds + 3 * decoding
    assert coded.seconds < all_streamed.seconds


@pytest.mark.parametrize("budget_gib", [6, 8])
def test_the_planner_pins_more_weights_coded_within_the_budget(budget_gib):
    model = shape_model("llama3-8b", torch.bfloat16)
    budget = budget_gib * 2**30
    plans = {}
    for codec in (False, True):
        with fixed_mechanisms(_mechanisms(codec)):
            plans[codec] = Planner(model, PROFILE, budget, context=1024, tiers=Tiers((1, 64))).plan()
    raw, coded = plans[False], plans[True]
    assert not raw.coded_names
    assert coded.coded_names and set(coded.coded_names) <= set(coded.pinned)
    assert coded.need.total <= budget
    pinned_bytes = {c: sum(sublayer_packed_bytes(model, n) for n in plans[c].pinned) for c in plans}
    assert pinned_bytes[True] > 1.25 * pinned_bytes[False]
    for tier in (1, 64):
        assert coded.tiers[tier].predicted_s < raw.tiers[tier].predicted_s
        assert coded.tiers[tier].placement.coded_names() == coded.coded_names  # (the same pins at every tier)
    assert any("kept coded in VRAM" in note for note in coded.notes)
    # The executor's own account of the plan's VRAM is the planner's.
    tiered = coded.tiered()
    from vramshard.plan.memory import tiered_vram_need
    assert tiered_vram_need(model, tiered, 1, 1024, 64).resident == coded.need.resident


@pytest.mark.parametrize("wire,vram", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("budget_gib", [8, 12])
def test_the_executor_counts_the_plans_vram_as_the_planner_does(wire, vram, budget_gib):
    """The executor's account of a plan (with the coded link's staging buffer where its fills cross coded)
    is the planner's, so a plan that fills its budget loads (the fifty-second GPU session: llama3-8b at 12 GiB,
    planned to the byte with coded pins, refused by the executor for the staging the planner left out)."""
    from pathlib import Path

    from vramshard.plan.memory import tiered_vram_need
    from vramshard.profile.store import load

    profile = load(Path(__file__).parents[1] / "docs/profiles/h100-run40.json", check_fingerprint=False)
    model = shape_model("llama3-8b", torch.bfloat16)
    budget = budget_gib * 2**30
    mechanisms = Mechanisms(False, False, False, (False, 0), False, wire, vram)
    with fixed_mechanisms(mechanisms):
        plan = Planner(model, profile, budget, context=2048, tiers=Tiers((1, 64, 1024))).plan()
    need = tiered_vram_need(model, plan.tiered(), 1, 2048, 1024, wire_coded=wire)
    assert need == plan.need
    assert need.total <= budget


def test_the_planner_leaves_pins_raw_where_decoding_costs_more_than_it_saves():
    """A GPU whose memory decodes slowly (a laptop's 200 GB/s): coding the pins is priced slower, and not taken."""
    slow = synthetic(cpu_gflops=1500, gpu_gflops=200_000, h2d_gbps=25, cpu_mem_gbps=60, gpu_mem_gbps=200)
    model = shape_model("llama3-8b", torch.bfloat16)
    with fixed_mechanisms(_mechanisms(True)):
        plan = Planner(model, slow, 8 * 2**30, context=1024, tiers=Tiers((1, 64))).plan()
    assert not plan.coded_names
    assert any("not coded" in note for note in plan.notes)


def test_fp16_models_are_never_coded():
    model = shape_model("llama3-8b", torch.float16)
    with fixed_mechanisms(_mechanisms(True)):
        plan = Planner(model, PROFILE, 8 * 2**30, context=1024, tiers=Tiers((1,))).plan()
    assert not plan.coded_names


def test_the_planning_request_carries_the_switch():
    model = shape_model("llama3-8b", torch.bfloat16)
    settings = budgets.PlanSettings(PROFILE, Tiers((1, 64)), 1024, 2, "llama3-8b")
    for codec in (False, True):
        request = plan_wire.request(plan_wire.model_recipe(model), settings, None, None, False, _mechanisms(codec))
        *_, mechanisms = plan_wire.read_request(plan_wire.loads(plan_wire.dumps(request)))
        assert mechanisms == _mechanisms(codec)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_executor_refuses_coded_pins_it_cannot_keep(tiny_model_dir, dtype):
    """Coded pins of fp32 weights, or of a sub-layer no stream slot holds (the head), are refused by name."""
    from vramshard import Engine
    from vramshard.runtime.executor import Executor

    engine = Engine.load(tiny_model_dir("llama", dtype), device="cpu")
    model = engine.model
    coded = ("attn",) if dtype == torch.float32 else ("attn", "head")
    placement = Placement("p", tuple((s.name, GPU_CODED if s.kind in coded else CPU) for s in model))
    with pytest.raises(InvalidInputError, match="bf16" if dtype == torch.float32 else "head"):
        Executor(model, engine.executor.host, placement, simulate_gpu=True)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("wire", ["off", "on"])
def test_coded_pins_compute_the_same_logits_bit_for_bit(bf16_llama, monkeypatch, wire):
    """Layers 0 and 1 pinned coded (decoded into the ring's slots), layer 2 streamed: the engine's logits and
    greedy tokens are those of the same layers pinned raw and of them streamed, bit for bit (eager steps: the
    decode graphs over raw pins run other kernels), and the coded pins hold less VRAM than their raw bytes."""
    from placement_helpers import PROMPT, trace_logits
    from vramshard import Engine

    monkeypatch.setenv("VRAMSHARD_WIRE_CODEC", wire)
    model = Engine.load(bf16_llama, device="cpu").model

    def placement(pin: Where) -> Placement:
        return Placement("p", tuple((s.name, CPU if s.kind == "embed" else GPU_RESIDENT if s.kind == "head"
                                     else pin if s.layer in (0, 1) else GPU_STREAMED) for s in model))

    out = {}
    for pin in (GPU_RESIDENT, GPU_STREAMED, GPU_CODED):
        engine = Engine.load(bf16_llama, device="cuda", dtype="bfloat16", max_context=64, placement=placement(pin),
                             decode_graphs=False)
        logits = trace_logits(engine)
        ex = engine.executor
        coded = list(ex._vram_coded.values())
        out[pin] = (logits, engine.generate([PROMPT], 12), ex.ring.decodes,
                    sum(c.vram_bytes for c in coded), sum(c.nbytes for c in coded))
        if pin == GPU_CODED and wire == "on":  # coded pins from the link's coded host copies; link decodes apart
            assert coded and all(c.copied for c in coded)
            assert ex.ring.overlap is not None and ex.ring.overlap.stream != ex.ring.decode_stream
        del engine, ex, coded
    for other in (GPU_RESIDENT, GPU_STREAMED):
        assert torch.equal(out[GPU_CODED][0], out[other][0])
        assert out[GPU_CODED][1] == out[other][1]
        assert out[other][2] == 0
    assert out[GPU_CODED][2] > 0
    assert 0 < out[GPU_CODED][3] < 0.8 * out[GPU_CODED][4]  # (the coded pins' VRAM against their raw bytes)


def test_only_sub_layers_whose_coded_buffer_is_smaller_may_be_coded():
    """A sub-layer of a few MiB codes into no less VRAM than it takes raw (the allocator's 2 MiB rounding):
    the planner never codes those; every attention and dense FFN of an 8B shape it may."""
    big = shape_model("llama3-8b", torch.bfloat16)
    with fixed_mechanisms(_mechanisms(True)):
        assert len(Planner(big, PROFILE, 8 * 2**30).codable) == 2 * big.args.num_hidden_layers
        config = {**shape_config("llama3-8b"), "hidden_size": 256, "intermediate_size": 1024,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 512}
        small = build_model(config, torch.bfloat16)
        assert Planner(small, PROFILE, 2**30).codable == []
    with fixed_mechanisms(_mechanisms(False)):
        assert Planner(big, PROFILE, 8 * 2**30).codable == []


def test_on_a_gpu_of_middling_memory_the_planner_codes_a_part_of_the_pins(monkeypatch):
    """At 1000 GB/s (an RTX 3090's memory, about) and 12 GiB, decoding every pin costs more than it saves and
    decoding none leaves room unused: a share of the pins coded is predicted faster than either. (At 504 GB/s,
    with the decodes priced in the GPU's memory time beside the compute kernels, none is coded at 12 GiB.)"""
    from vramshard.plan import planner

    mid = synthetic(cpu_gflops=1000, gpu_gflops=100_000, h2d_gbps=25, cpu_mem_gbps=60, gpu_mem_gbps=1000)
    model = shape_model("llama3-8b", torch.bfloat16)

    def plan(codec: bool):
        with fixed_mechanisms(_mechanisms(codec)):
            made = Planner(model, mid, 12 * 2**30, context=1024, tiers=Tiers((1, 64, 1024)))
            return made, made.plan()

    made, part = plan(True)
    _, raw = plan(False)
    monkeypatch.setattr(planner, "CODED_SHARES", (1.0,))
    _, every = plan(True)
    assert 0 < len(part.coded_names) < len([n for n in part.pinned if n in made.codable])
    assert made._score(part) < made._score(raw)
    assert made._score(part) < made._score(every)
    assert any(note.startswith("coded pins:") for note in part.notes)


def test_the_prediction_table_compares_coded_and_raw_pins():
    from benchmarks.vram_codec_plans import TIERS, plan_cells

    fast = synthetic(cpu_gflops=1000, gpu_gflops=100_000, h2d_gbps=50, cpu_mem_gbps=80, gpu_mem_gbps=1790)
    [row] = plan_cells(shape_model("llama3-8b", torch.bfloat16), fast, [12])
    assert row["raw"]["coded_sub_layers"] == 0 < row["coded"]["coded_sub_layers"]
    assert row["coded"]["pinned_weight_gib"] > row["raw"]["pinned_weight_gib"]
    assert all(row["coded"]["predicted_ms"][t] < row["raw"]["predicted_ms"][t] for t in TIERS)


def test_a_coded_plan_crosses_the_wire_and_says_what_its_pins_hold():
    from rich.console import Console

    from vramshard.plan.report import print_plan

    model = shape_model("llama3-8b", torch.bfloat16)
    with fixed_mechanisms(_mechanisms(True)):
        plan = Planner(model, PROFILE, 8 * 2**30, context=1024, tiers=Tiers((1, 64))).plan()
    back = plan_wire.plan_from_wire(plan_wire.loads(plan_wire.dumps(plan_wire.plan_to_wire(plan))))
    assert back.coded_names == plan.coded_names and back.pinned_weight_bytes == plan.pinned_weight_bytes
    assert plan.pinned_weight_bytes == sum(sublayer_packed_bytes(model, n) for n in plan.pinned) > plan.need.resident
    console = Console(record=True, width=200)
    print_plan(plan, console)
    text = console.export_text()
    assert f"{len(plan.coded_names)} sub-layers coded" in text
    # With the link coded too, the host holds the coded copies of the streamed sub-layers and of the coded pins
    # (the executor loads those from them), not of the pins kept raw.
    from vramshard.cli.plan import coded_fills_note
    from vramshard.runtime import wire_codec
    from vramshard.units import format_bytes

    with fixed_mechanisms(Mechanisms(False, False, False, (False, 0), False, True, True)):
        both = Planner(model, PROFILE, 8 * 2**30, context=1024, tiers=Tiers((1, 64))).plan()
        note = coded_fills_note(model, both)
    raw_pins = set(both.pinned) - set(both.coded_names)
    assert both.coded_names and raw_pins
    held = sum(sublayer_packed_bytes(model, s.name) for s in model
               if s.kind in ("attn", "ffn") and s.name not in raw_pins)
    assert f"take up to {format_bytes(wire_codec.coded_bytes(held))} more" in note


def test_a_measured_decode_rate_prices_the_decodes_and_a_bad_one_is_refused():
    """The profile's ``vram_decode`` (measured where the kernel runs) prices each decode; without it the
    GPU's one-row read at DECODE_SHARE does; a table with a zero time is not a profile."""
    from vramshard.errors import ProfileError
    from vramshard.plan.estimator import DECODE_SHARE
    from vramshard.profile.query import Profile

    model = shape_model("llama3-8b", torch.bfloat16)
    ffn = model["ffn[0]"]
    data = PROFILE.to_dict()
    read = 4096 * 14336 * 2 / PROFILE.matmul_s(1, 4096, 14336, torch.bfloat16, "cuda")
    assert vram_decode_bps(PROFILE) == pytest.approx(DECODE_SHARE * read)
    measured = Profile.from_dict({**data, "vram_decode": {"bytes": 352_321_536, "seconds": 0.001}})
    assert vram_decode_bps(measured) == pytest.approx(352.321536e9)
    assert Estimator(model, measured).decode_s(ffn) \
        == pytest.approx(sublayer_packed_bytes(model, "ffn[0]") / 352.321536e9)
    assert measured.summary()["vram_decode_gb_s"] == pytest.approx(352.321536)
    with pytest.raises(ProfileError, match="decode of coded weights"):
        Profile.from_dict({**data, "vram_decode": {"bytes": 352_321_536, "seconds": 0}})


@pytest.mark.gpu
@gpu
def test_the_profiler_measures_the_decode_of_coded_weights():
    from vramshard.profile.bench_decode import RAW_BYTES, measure_vram_decode
    from vramshard.profile.progress import ProgressSink

    table = measure_vram_decode(budget_s=0.05, progress=ProgressSink(), weight=1.0)
    assert table is not None and 0.99 * RAW_BYTES <= table["bytes"] <= RAW_BYTES
    assert 1e9 < table["bytes"] / table["seconds"] < 20e12  # (between 1 GB/s and 20 TB/s)
