"""The link codec (runtime/wire_codec.py): any bytes round-trip exactly through its blocks, fills of any
range put back the raw bytes, bf16 weights cross in RATIO of their bytes, and the planner prices and
budgets what the executor will run."""

import pytest
import torch

from vramshard.plan.estimator import Estimator
from vramshard.plan.mechanisms import Mechanisms, fixed_mechanisms
from vramshard.plan.memory import vram_need
from vramshard.plan.placement import CPU, GPU_STREAMED, Placement
from vramshard.models import build_model
from vramshard.runtime import budget as budgets
from vramshard.plan.tiers import Tiers
from vramshard.profile.query import synthetic
from vramshard.runtime import plan_wire, wire_codec
from vramshard.runtime.wire_codec import (BLOCK, BLOCK_BYTES, CODED_BLOCK, ESCAPES, RATIO, STAGING_BYTES,
                                          CodedBuffer, FillStats, OverlappedDecode, decode_into, decode_torch,
                                          encode_blocks)
from vramshard.shapes import shape_config, shape_model

PROFILE = synthetic(cpu_gflops=1500, gpu_gflops=200_000, h2d_gbps=50, cpu_mem_gbps=80, gpu_mem_gbps=1500)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def weights(n: int, seed: int = 0, dtype=torch.bfloat16) -> torch.Tensor:
    """``n`` weights as raw bytes: normal at std 0.02, with heavy tails (a t-distribution's) in the second
    half, as trained weights have, and a few zeros, infinities and NaNs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 0.02
    half = n // 2
    x[half:] = x[half:] / torch.rand(n - half, generator=g).clamp_min(1e-3).sqrt()
    x[:: 997] = 0.0
    x[5] = float("inf")
    x[11] = float("nan")
    x[17] = -0.0
    return x.to(dtype).view(torch.uint8)


def test_blocks_round_trip_any_words_bit_for_bit():
    bf16 = weights(BLOCK * 8).view(torch.int16)
    noise = torch.randint(-2**15, 2**15, (BLOCK * 3,), dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    noise = noise.to(torch.int16)
    for words in (bf16, noise):
        coded = encode_blocks(words)
        assert coded.shape == (words.numel() // BLOCK, CODED_BLOCK)
        flags = coded[:, 15]
        back = decode_torch(coded.reshape(-1)).view(-1, BLOCK)
        whole = words.view(-1, BLOCK)
        # Every block that did not overflow its escapes decodes to its words exactly.
        assert torch.equal(back[flags == 0], whole[flags == 0])
    assert not encode_blocks(bf16)[:, 15].any()  # weights never overflow
    assert encode_blocks(noise)[:, 15].all()  # noise always does


def test_a_block_at_its_escape_limit_decodes_and_one_past_it_overflows():
    words = torch.zeros(BLOCK, dtype=torch.int16)
    # 15 frequent exponents fill the table; ESCAPES words of rarer exponents (each distinct) escape.
    group = (BLOCK - ESCAPES) // 15
    for i in range(15):
        words[i * group : (i + 1) * group] = ((100 + i) << 7) | i
    rare = torch.arange(ESCAPES + 1, dtype=torch.int16)
    words[-ESCAPES:] = ((rare[:ESCAPES] + 1) << 7) | 0x15
    coded = encode_blocks(words)
    assert coded[0, 15] == 0
    assert torch.equal(decode_torch(coded.reshape(-1)), words)
    words[0] = ((ESCAPES + 1) << 7) | 0x2A  # one more escape (its group keeps its place in the table)
    assert encode_blocks(words)[0, 15] == 1


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, gpu])])
def test_fills_of_any_range_give_back_the_raw_bytes(device):
    raw = weights(BLOCK * 150 + 777)  # a ragged last block
    raw[BLOCK_BYTES * 7 : BLOCK_BYTES * 8] = torch.randint(0, 256, (BLOCK_BYTES,), dtype=torch.uint8)  # overflows
    coded = CodedBuffer(raw, device)
    assert coded.overflow == [7]
    staging = torch.empty(3 * CODED_BLOCK, dtype=torch.uint8, device=device)  # rounds of 3 blocks
    ranges = [(0, raw.numel()), (2, raw.numel() - 2), (BLOCK_BYTES, 5 * BLOCK_BYTES), (10, 300),
              (BLOCK_BYTES - 2, 2 * BLOCK_BYTES + 2), (6 * BLOCK_BYTES + 4, 9 * BLOCK_BYTES)]
    for begin, end in ranges:
        target = torch.full((end - begin,), 0xAB, dtype=torch.uint8, device=device)
        stats = FillStats()
        coded.fill(target, begin, end, staging, stats)
        assert torch.equal(target.cpu(), raw[begin:end]), (begin, end)
        assert stats.raw == end - begin and stats.wire == coded.wire_bytes(begin, end)
    whole = FillStats()
    coded.fill(torch.empty_like(raw, device=device), 0, raw.numel(), staging, whole)
    # 150 coded blocks, the overflowed one again raw, and the ragged end raw.
    assert whole.wire == 150 * CODED_BLOCK + BLOCK_BYTES + 2 * 777
    if device == "cuda":
        assert not coded.capturable  # (pageable: a graph cannot copy from it)
        overlapped_fills_give_back_the_raw_bytes(coded, raw, ranges, captured=False)
        pinned = raw.pin_memory()
        overlapped_fills_give_back_the_raw_bytes(CodedBuffer(pinned, device), pinned, ranges, captured=True)


def overlapped_fills_give_back_the_raw_bytes(coded: CodedBuffer, raw: torch.Tensor, ranges, captured: bool) -> None:
    """The ring's way: rounds through the staging's halves, decoded on a stream of their own; each range's fill
    made three times into one target: round by round, then (from page-locked memory, ``captured``) captured as a
    graph, then replayed from it; the same round by round throughout with the graphs off."""
    copy = torch.cuda.Stream()
    staging = torch.empty(6 * CODED_BLOCK, dtype=torch.uint8, device="cuda")
    for graphs in (True, False):
        overlap = OverlappedDecode(staging, torch.cuda.Stream(), graphs=graphs)
        with_blocks = 0
        for begin, end in ranges:
            first, last = CodedBuffer._blocks(begin, end)
            with_blocks += last > first
            target = torch.empty(end - begin, dtype=torch.uint8, device="cuda")
            for _ in range(3):
                target.fill_(0xAB)
                copy.wait_stream(torch.cuda.current_stream())
                stats = FillStats()
                with torch.cuda.stream(copy):
                    coded.fill(target, begin, end, staging, stats, overlap)
                    after = target.clone()  # (on the copy stream: after the fill's last decode)
                torch.cuda.synchronize()
                assert torch.equal(after.cpu(), raw[begin:end]), (begin, end, graphs)
                assert stats.raw == end - begin and stats.wire == coded.wire_bytes(begin, end)
        want = (with_blocks, 2 * with_blocks) if graphs and captured else (0, 0)
        assert (overlap.captures, overlap.replays) == want
        assert overlap.graphs == graphs  # (no capture failed)
        assert overlap.rounds > len(ranges)



def test_fill_graphs_are_captured_at_a_fills_second_run_and_kept_per_buffer_and_place(monkeypatch):
    """The bookkeeping of the fill graphs, without a GPU (torch's events and graphs faked; the GPU test above runs
    the real ones): a fill's first run goes round by round, its second is captured and replayed, later ones replay
    that graph; another target or range is another fill; a buffer's graphs go with it; a capture that fails turns
    the graphs off, and that fill and every later one go round by round."""
    import gc

    class FakeGraph:
        fail = False

        def __init__(self):
            self.replays = 0

        def capture_begin(self, capture_error_mode):
            assert capture_error_mode == "thread_local"

        def capture_end(self):
            if FakeGraph.fail:
                raise RuntimeError("capture invalidated")

        def replay(self):
            self.replays += 1

    monkeypatch.setattr(wire_codec.torch.cuda, "Event", lambda: object())
    monkeypatch.setattr(wire_codec.torch.cuda, "CUDAGraph", FakeGraph)
    issued = []
    monkeypatch.setattr(CodedBuffer, "_fill_blocks", lambda self, target, begin, end, *rest: issued.append(
        (target.data_ptr(), begin, end)))
    coded = CodedBuffer(weights(BLOCK * 8))
    coded.capturable = True  # (as a pinned buffer's)
    overlap = OverlappedDecode(torch.empty(4 * CODED_BLOCK, dtype=torch.uint8), decode_stream=None, graphs=True)
    a, b = torch.empty(BLOCK_BYTES * 8, dtype=torch.uint8), torch.empty(BLOCK_BYTES * 8, dtype=torch.uint8)
    whole = (0, BLOCK_BYTES * 8)
    for _ in range(4):
        coded.fill(a, *whole, staging=None, overlap=overlap)
    # Round by round once; captured once (the fake issues nothing while capturing, as a capture runs nothing).
    assert issued == [(a.data_ptr(), *whole)] * 2 and (overlap.captures, overlap.replays) == (1, 3)
    graph = overlap._graphs[coded][(a.data_ptr(), *whole)]
    assert graph.replays == 3
    coded.fill(b, *whole, staging=None, overlap=overlap)  # another place: round by round first
    coded.fill(a[:BLOCK_BYTES * 4], 0, BLOCK_BYTES * 4, staging=None, overlap=overlap)  # another range
    assert len(issued) == 4 and overlap.replays == 3
    del coded
    gc.collect()
    assert len(overlap._graphs) == 0  # (the graphs went with their buffer)
    FakeGraph.fail = True
    other = CodedBuffer(weights(BLOCK * 8, seed=1))
    other.capturable = True
    for _ in range(3):
        other.fill(a, *whole, staging=None, overlap=overlap)
    assert not overlap.graphs and overlap.captures == 1 and len(issued) == 4 + 3 + 1  # (+1: the failed capture's)


def test_bf16_weights_cross_in_the_ratio_and_other_bytes_stay_raw():
    bf16 = CodedBuffer(weights(BLOCK * 64))
    assert bf16.coded is not None and bf16.wire_bytes() == 64 * CODED_BLOCK
    assert bf16.wire_bytes() / bf16.raw.numel() == pytest.approx(RATIO) and RATIO < 0.76
    fp16 = CodedBuffer(weights(BLOCK * 64, dtype=torch.float16))
    assert fp16.coded is None and fp16.wire_bytes() == fp16.raw.numel() and fp16.host_bytes == 0
    target = torch.empty_like(fp16.raw)
    fp16.fill(target, 0, target.numel(), torch.empty(CODED_BLOCK, dtype=torch.uint8))
    assert torch.equal(target, fp16.raw)


def test_the_switch_reads_on_and_off(monkeypatch):
    monkeypatch.delenv("VRAMSHARD_WIRE_CODEC", raising=False)  # (on by default)
    assert wire_codec.enabled()
    assert wire_codec.wire_ratio(torch.bfloat16) == RATIO and wire_codec.wire_ratio(torch.float16) == 1.0
    monkeypatch.setenv("VRAMSHARD_WIRE_CODEC", "off")
    assert not wire_codec.enabled() and wire_codec.wire_ratio(torch.bfloat16) == 1.0


def _mechanisms(codec: bool) -> Mechanisms:
    return Mechanisms(False, False, False, (False, 0), False, codec)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_planner_prices_and_budgets_coded_fills(dtype):
    """With the codec on, a bf16 model's streamed fills are priced at RATIO of their bytes and its plans
    hold the staging buffer; an fp16 model's are as without it."""
    model = shape_model("llama3-8b", getattr(torch, dtype))
    placement = Placement("stream", tuple((s.name, GPU_STREAMED) for s in model))
    ffn = next(s for s in model if s.kind == "ffn")
    results = {}
    for codec in (False, True):
        with fixed_mechanisms(_mechanisms(codec)):
            estimator = Estimator(model, PROFILE)
            need = vram_need(model, placement, 1, 1024, 16)
            results[codec] = (estimator.copy_s(ffn), need.slots, estimator.simulate(placement, 1, 1024).bytes_streamed)
    coded = dtype == "bfloat16"
    off, on = results[False], results[True]
    if coded:
        assert on[0] < 0.8 * off[0]
        assert on[1] == off[1] + STAGING_BYTES
        assert on[2] == pytest.approx(RATIO * off[2], rel=1e-3)
    else:
        assert on == off


def test_the_planning_request_carries_the_codec():
    model = build_model(shape_config("llama3-8b"), torch.bfloat16)
    settings = budgets.PlanSettings(PROFILE, Tiers((1, 64)), 1024, 2, "llama3-8b")
    for codec in (False, True):
        request = plan_wire.request(plan_wire.model_recipe(model), settings, None, None, False, _mechanisms(codec))
        *_, mechanisms = plan_wire.read_request(plan_wire.loads(plan_wire.dumps(request)))
        assert mechanisms == _mechanisms(codec)


@pytest.mark.gpu
@gpu
def test_the_kernel_decodes_as_torch_does():
    raw = weights(BLOCK * 300)
    coded = encode_blocks(raw.view(torch.int16).cuda()).reshape(-1).contiguous()
    out = torch.zeros(BLOCK * 300, dtype=torch.int16, device="cuda")
    decode_into(coded, out)
    assert torch.equal(out.cpu(), raw.view(torch.int16))
    assert torch.equal(decode_torch(coded).cpu(), raw.view(torch.int16))
    assert coded.numel() <= STAGING_BYTES * 300 // 4096


def _streamed_placement(model, split: bool) -> Placement:
    from vramshard.plan.placement import CPU, GPU_RESIDENT, split_ffn

    fixed = {"embed": CPU, "head": GPU_RESIDENT}
    return Placement("coded", tuple((s.name, fixed.get(s.kind) or (
        split_ffn(5) if split and s.kind == "ffn" else GPU_STREAMED)) for s in model))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
def test_coded_fills_compute_the_same_logits_bit_for_bit(bf16_llama, monkeypatch, split):
    """Streamed whole and as split FFNs' GPU parts, the engine's logits and greedy tokens with the codec
    are those without it, bit for bit, while its fills cross the link in about RATIO of their bytes."""
    from placement_helpers import PROMPT, trace_logits
    from vramshard import Engine

    out = {}
    for codec in ("off", "on"):
        monkeypatch.setenv("VRAMSHARD_WIRE_CODEC", codec)
        engine = Engine.load(bf16_llama, device="cuda", dtype="bfloat16", max_context=64,
                             placement=_streamed_placement(Engine.load(bf16_llama, device="cpu").model, split))
        logits = trace_logits(engine)
        ring = engine.executor.ring
        out[codec] = (logits, engine.generate([PROMPT], 12), ring.fills.wire / ring.fills.raw,
                      engine.executor.report.bytes_streamed)
        if codec == "on":  # the fills after each one's first two replayed from their graphs (FILL_GRAPHS)
            assert ring.overlap.captures > 0 and ring.overlap.replays > ring.overlap.captures
        del engine
    assert torch.equal(out["on"][0], out["off"][0])
    assert out["on"][1] == out["off"][1]
    assert out["off"][2] == 1.0 and out["on"][2] < 0.8
    assert out["on"][3] < 0.8 * out["off"][3]


def test_the_coded_copies_are_made_only_where_half_the_available_host_memory_holds_them():
    raw = 1000 * BLOCK_BYTES
    need = 1000 * CODED_BLOCK
    assert wire_codec.host_room(raw, None) == need  # (unknown: no limit)
    assert wire_codec.host_room(raw, 2 * need) == need
    assert wire_codec.host_room(raw, 2 * need - 1) is None
    assert wire_codec.host_room(raw + 1, None) == need + CODED_BLOCK  # (a part block counts whole)


def test_vramshard_plan_says_where_fills_are_coded(tmp_path, monkeypatch, capsys):
    """With the codec on, `vramshard plan` of a bf16 model that streams says so (and what it costs), and
    predicts a faster prompt step (tier 512 streams its weights); off, nothing is said."""
    import json

    from vramshard.cli.main import main
    from vramshard.profile import save
    from vramshard.profile.fingerprint import fingerprint_hash, machine_fingerprint
    from vramshard.profile.query import Profile
    from vramshard.profile.synthetic import synthetic_data

    data = synthetic_data(cpu_gflops=400, gpu_gflops=50_000, h2d_gbps=20, cpu_mem_gbps=40, gpu_mem_gbps=900)
    fingerprint = machine_fingerprint()
    data.update(synthetic=False, fingerprint=fingerprint, fingerprint_hash=fingerprint_hash(fingerprint),
                created="2026-12-07T08:00:00+00:00")
    path = save(Profile(data), tmp_path / "profile.json")
    monkeypatch.setenv("VRAMSHARD_DRIFT_CHECK", "off")
    planned = {}
    for codec in ("off", "on"):
        monkeypatch.setenv("VRAMSHARD_WIRE_CODEC", codec)
        assert main(["plan", "--shape", "llama3-8b", "--vram", "4GiB", "--ctx", "1024", "--tiers", "1,512",
                     "--profile", str(path), "--json"]) == 0
        planned[codec] = json.loads(capsys.readouterr().out)
    said = {codec: [n for n in plan["notes"] if "VRAMSHARD_WIRE_CODEC" in n] for codec, plan in planned.items()}
    assert not said["off"] and len(said["on"]) == 1
    assert "x0.754" in said["on"][0] and "pinned host memory" in said["on"][0]
    assert planned["on"]["tiers"]["512"]["predicted_ms"] < 0.9 * planned["off"]["tiers"]["512"]["predicted_ms"]


def test_the_exponent_statistics_tell_weights_from_noise():
    from benchmarks.wire_codec import exponent_stats

    weights = exponent_stats(torch.randn(BLOCK * 16, generator=torch.Generator().manual_seed(0)) * 0.02, "normal")
    assert 2.0 < weights["entropy_bits"] < 3.5 and weights["blocks"] == 16 and weights["overflowed"] == 0
    assert weights["escapes_max"] <= ESCAPES
    bits = torch.randint(-2**15, 2**15, (BLOCK * 4,), dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    noise = exponent_stats(bits.to(torch.int16).view(torch.bfloat16), "noise")
    assert noise["entropy_bits"] > 7.0 and noise["overflowed"] == 4


def _has_flags(*flags: str) -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return all(flag in line.split() for flag in flags)


@pytest.mark.skipif(not _has_flags("avx512bw", "avx512vbmi"), reason="the probe needs AVX-512BW and VBMI")
def test_the_cpu_probe_of_coded_rows_computes_the_product(tmp_path):
    """benchmarks/coded_gemv.py's C probe (rows decoded in registers, escapes corrected after) gives float64
    W @ x within float32 rounding, as the raw loops do (its exit code says so)."""
    import json

    from benchmarks.coded_gemv import main

    out = tmp_path / "probe.json"
    assert main(["--rows", "256", "--repeats", "3", "--cold-mib", "4", "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert results["coded probe"]["bytes"] == 256 * CODED_BLOCK
    assert all(results[k]["max_rel_error"] < 1e-4 for k in ("engine kernel", "raw probe", "coded probe"))


def test_an_engine_whose_host_cannot_hold_the_coded_copies_plans_raw_fills(tiny_model_dir, monkeypatch):
    """The link codec on, a bf16 model: where half the host memory left beside the pinned weights holds the coded
    copies of every streamable sub-layer the engine's plans price coded fills; where it does not, they price raw
    fills (in this process and in the planning process's request), as the executor will make them."""
    from vramshard import Engine, engine as engine_module
    from vramshard.plan.memory import sublayer_packed_bytes

    monkeypatch.setenv("VRAMSHARD_WIRE_CODEC", "on")
    path = tiny_model_dir("llama", torch.bfloat16)
    model = Engine.load(path, device="cpu").model
    weights = sum(sublayer_packed_bytes(model, s.name) for s in model)
    streamable = sum(sublayer_packed_bytes(model, s.name) for s in model if s.kind in ("attn", "ffn"))
    assert wire_codec.holds_coded_copies(streamable, weights, None)
    assert wire_codec.holds_coded_copies(streamable, weights, weights + 2 * wire_codec.coded_bytes(streamable))
    assert not wire_codec.holds_coded_copies(streamable, weights, weights + 2 * wire_codec.coded_bytes(streamable) - 1)
    from vramshard.plan.mechanisms import wire_codec_enabled

    priced = []

    class Planner(engine_module.Planner):  # the load's planner: what it prices
        def __init__(self, *args, **kwargs):
            priced.append(wire_codec_enabled())
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(engine_module, "Planner", Planner)
    monkeypatch.setattr(budgets, "Planner", Planner)  # (re-plans made in this process)
    for room, coded in ((2 * wire_codec.coded_bytes(streamable), True), (wire_codec.coded_bytes(streamable), False)):
        monkeypatch.setattr(engine_module, "available_host_bytes", lambda: weights + room)
        engine = Engine.load(path, vram=2**30, simulate_gpu=True, profile=PROFILE, max_step_tokens=16)
        assert priced.pop() is coded
        settings = engine.budget.settings
        assert settings.wire_codec is (None if coded else False)
        assert settings.mechanisms().wire_codec is coded
        assert engine.executor.wire_codec is coded
        # The planning process is asked to price the same (its request, caught before a child is started).
        from vramshard.runtime import plan_process

        asked = []

        def request(*args):
            asked.append(args[-1])
            raise plan_process.NotBuildable("caught")

        monkeypatch.setattr(plan_process.plan_wire, "request", request)
        with pytest.raises(plan_process.NotBuildable, match="caught"):
            plan_process.PlanProcess().make_plan(engine.model, settings, 2**30)
        assert asked[0].wire_codec is coded
        budgets.make_plan(engine.model, settings, 2**30, search=False)
        assert priced.pop() is coded
        with settings.pricing():
            assert Estimator(engine.model, PROFILE).wire_ratio == (RATIO if coded else 1.0)


def test_where_the_host_lacks_room_the_pins_go_without_coded_copies_but_the_link_stays_coded(bf16_llama, monkeypatch):
    """The coded host copies of sub-layers pinned coded in VRAM only spare a switch their coding: where the host
    has no room for them, they are not made and the link's fills stay coded; for streamed sub-layers the same lack
    of room leaves the fills raw (the executor's ``_code``, checked before anything is coded)."""
    from vramshard import Engine
    from vramshard.runtime import executor as executor_module

    engine = Engine.load(bf16_llama, device="cpu", dtype="bfloat16")
    ex = engine.executor
    names = [s.name for s in engine.model if s.kind == "ffn"]
    monkeypatch.setattr(executor_module, "available_host_bytes", lambda: 1)
    ex.wire_codec = True
    ex._code(names, pins=True)
    assert ex.wire_codec and all(ex.host[n].coded is None for n in names)
    ex._code(names)
    assert not ex.wire_codec and all(ex.host[n].coded is None for n in names)


@pytest.mark.parametrize("link_coded", [False, True])
def test_the_executor_counts_the_staging_by_its_own_link(bf16_llama, monkeypatch, link_coded):
    """An executor whose fills cross coded counts the ring's staging buffer in its VRAM, one whose fills cross
    raw does not, whatever the switch says (an engine decides its link before planning: PlanSettings)."""
    from vramshard import Engine
    from vramshard.runtime.executor import Executor

    monkeypatch.setenv("VRAMSHARD_WIRE_CODEC", "off" if link_coded else "on")
    engine = Engine.load(bf16_llama, device="cpu", dtype="bfloat16")
    model = engine.model
    placement = Placement("p", tuple((s.name, GPU_STREAMED if s.kind in ("attn", "ffn") else CPU) for s in model))
    ex = Executor(model, engine.executor.host, placement, simulate_gpu=True, wire_codec_on=link_coded)
    largest = max(engine.executor.host[s.name].layout.nbytes for s in model if s.kind in ("attn", "ffn"))
    assert ex.need.slots == 2 * largest + (STAGING_BYTES if link_coded else 0)
