"""CPU FFN parts from oneDNN-prepacked weights (runtime/cpu_packed.py, VRAMSHARD_CPU_PACKED): the
same products as the plain weights, in a split FFN's CPU part (a simulated GPU) and in FFNs placed
on the CPU, at few and many rows; by default (auto) only beside a GPU and within a share of the
host's available memory, the parts beyond it plain (with their down copies); a CPU that cannot
pack falls back."""

import pytest
import torch

from vramshard import Engine
from vramshard.layers.mlp import swiglu
from vramshard.plan.placement import TieredPlacement
from vramshard.profile.query import Profile
from vramshard.runtime import cpu_packed

from placement_helpers import PROMPT, trace_logits
from test_split_ffn import LONG_PROMPT, _ffn, _split_placement, _whole

needs_mkldnn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN (mkldnn)")


@needs_mkldnn
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_a_packed_part_computes_the_pieces_swiglu(dtype, tol, rows):
    ffn, weights = _ffn(dtype)
    whole = _whole(ffn, weights)
    h = torch.randn(rows, ffn.hidden).to(dtype)
    for first, last in ((0, 5), (0, ffn.num_pieces)):
        part = ffn.pieces_of(whole, first, last)
        expected = swiglu(h.float(), part["gate_proj"].float(), part["up_proj"].float(), part["down_proj"].float())
        got = cpu_packed.PackedPart(part, rows).contribution(h).float()
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol * expected.abs().max().item())


@needs_mkldnn
@pytest.mark.parametrize("prompt", [PROMPT, LONG_PROMPT])
def test_split_and_cpu_ffns_from_packed_weights_match_the_plain_ones(tiny_model_dir, monkeypatch, prompt):
    path = tiny_model_dir("llama")
    reference = Engine.load(path, device="cpu")
    expected = trace_logits(reference, prompt=prompt)
    monkeypatch.setattr(cpu_packed, "MODE", "on")
    split = Engine.load(path, placement=_split_placement(reference.model, [3, 15]), simulate_gpu=True, max_context=64)
    torch.testing.assert_close(trace_logits(split, prompt=prompt), expected, rtol=1e-5, atol=1e-5)
    assert {key for key in split.executor._packed._parts} == {("ffn[0]", 3), ("ffn[1]", 15)}
    assert split.executor._down_copies.nbytes == 0  # the packed parts are copies enough
    on_cpu = Engine.load(path, device="cpu")
    torch.testing.assert_close(trace_logits(on_cpu, prompt=prompt), expected, rtol=1e-5, atol=1e-5)
    pieces = on_cpu.model["ffn[0]"].num_pieces
    assert {key for key in on_cpu.executor._packed._parts} == {("ffn[0]", pieces), ("ffn[1]", pieces)}
    assert on_cpu.executor._down_copies.nbytes == 0


def test_packing_is_off_without_a_gpu_unless_asked_for_and_a_cpu_that_cannot_pack_runs_plain(monkeypatch, caplog):
    ffn, weights = _ffn(torch.bfloat16)
    part = ffn.pieces_of(_whole(ffn, weights), 0, 4)
    for mode in ("auto", "off"):
        parts = cpu_packed.PackedParts(mode, gpu=False)
        assert parts.get("ffn[0]", 4, part, 8) is None and not parts.enabled
    assert not cpu_packed.PackedParts("off", gpu=True).enabled
    if torch.backends.mkldnn.is_available():
        assert cpu_packed.PackedParts("auto", gpu=True).enabled and cpu_packed.PackedParts("on", gpu=False).enabled
    monkeypatch.setattr(cpu_packed, "MODE", "on")

    def cannot(*args, **kwargs):
        raise RuntimeError("mkldnn bf16 path needs the cpu support avx512bw, avx512vl and avx512dq")

    monkeypatch.setattr(cpu_packed.PackedPart, "__init__", cannot)
    parts = cpu_packed.PackedParts()
    with caplog.at_level("WARNING"):
        assert parts.get("ffn[0]", 4, part, 8) is None
    assert not parts.enabled and "oneDNN cannot pack them here" in caplog.text
    assert parts.get("ffn[1]", 4, part, 8) is None  # tried once


@needs_mkldnn
def test_a_new_plan_drops_the_packed_parts_it_no_longer_computes(tiny_model_dir, monkeypatch):
    """The first tier's parts are packed when the plans are made (at load, at a switch), not in a
    step. Each plan splits FFNs anew: the parts of the plan before are dropped when the executor
    switches (their memory with them), and the time spent packing is counted once, apart."""
    from vramshard.layers import cpu_gemv

    path = tiny_model_dir("llama")
    monkeypatch.setattr(cpu_packed, "MODE", "on")
    monkeypatch.setattr(cpu_gemv, "computes", lambda rows: False)  # (the kernel's one-row steps read no packed part)
    reference = Engine.load(path, device="cpu")
    split = Engine.load(path, placement=_split_placement(reference.model, [3, 15]), simulate_gpu=True, max_context=64)
    packed = split.executor._packed
    assert set(packed._parts) == {("ffn[0]", 3), ("ffn[1]", 15)} and packed.nbytes > 0 and packed.packing_s > 0
    spent = packed.packing_s
    trace_logits(split)
    assert packed.packing_s == spent  # nothing packed in the steps
    split.executor.reconfigure(_split_placement(reference.model, [5, 15]), None)
    assert set(packed._parts) == {("ffn[0]", 5), ("ffn[1]", 15)} and packed.packing_s > spent
    assert packed.nbytes == sum(p.nbytes for p in packed._parts.values())
    torch.testing.assert_close(trace_logits(split), trace_logits(reference), rtol=1e-5, atol=1e-5)
    assert set(packed._parts) == {("ffn[0]", 5), ("ffn[1]", 15)}


@needs_mkldnn
def test_a_plan_packed_ahead_comes_into_force_without_packing_at_the_switch(tiny_model_dir, monkeypatch):
    """prepare() packs a plan's parts before it comes into force, off the steps (its seconds in ahead_s, no
    step's packing_s); the plan in force keeps its own until the switch, which packs nothing and drops them;
    the logits are the CPU placement's."""
    from vramshard.layers import cpu_gemv

    path = tiny_model_dir("llama")
    monkeypatch.setattr(cpu_packed, "MODE", "on")
    monkeypatch.setattr(cpu_gemv, "computes", lambda rows: False)
    reference = Engine.load(path, device="cpu")
    split = Engine.load(path, placement=_split_placement(reference.model, [3, 15]), simulate_gpu=True, max_context=64)
    executor, packed = split.executor, split.executor._packed
    before, spent = set(packed._parts), packed.packing_s
    executor.prepare(TieredPlacement.single(_split_placement(reference.model, [5, 15])))
    assert set(packed._parts) == before | {("ffn[0]", 5)} and packed.ahead_s > 0 and packed.packing_s == spent
    torch.testing.assert_close(trace_logits(split), trace_logits(reference), rtol=1e-5, atol=1e-5)
    assert ("ffn[0]", 5) in packed._parts and packed.packing_s == spent  # (the steps kept the part packed ahead)
    executor.reconfigure(_split_placement(reference.model, [3, 15]), None)  # (another plan first: a quick one)
    assert ("ffn[0]", 5) in packed._parts and packed.packing_s == spent
    report = executor.reconfigure(_split_placement(reference.model, [5, 15]), None)
    assert set(packed._parts) == {("ffn[0]", 5), ("ffn[1]", 15)} and packed.packing_s == spent  # nothing to pack
    # (The switch's host-side work is in its report, by phase.)
    assert set(report.apply_parts) == {"CPU parts", "CPU kernels", "VRAM"}
    assert 0 < sum(report.apply_parts.values()) < report.total_s
    assert packed.nbytes == sum(p.nbytes for p in packed._parts.values())
    torch.testing.assert_close(trace_logits(split), trace_logits(reference), rtol=1e-5, atol=1e-5)
    # A plan packed ahead that never comes into force: its parts go at the switch after the next one's.
    executor.prepare(TieredPlacement.single(_split_placement(reference.model, [7, 15])))
    executor.prepare(TieredPlacement.single(_split_placement(reference.model, [9, 15])))
    executor.reconfigure(_split_placement(reference.model, [9, 15]), None)
    assert set(packed._parts) == {("ffn[0]", 9), ("ffn[1]", 15)} and packed.packing_s == spent
    monkeypatch.setattr(cpu_packed, "PACK_AHEAD", False)
    executor.prepare(TieredPlacement.single(_split_placement(reference.model, [11, 15])))
    assert ("ffn[0]", 11) not in packed._parts


@needs_mkldnn
def test_the_pack_ahead_benchmark_switches_without_packing_where_it_packed_ahead(monkeypatch):
    """benchmarks.pack_ahead on a tiny shape: the switches that packed ahead pack nothing themselves, the
    others pack their parts in the switch; packing ahead leaves the packing mode as it was."""
    from benchmarks import pack_ahead

    monkeypatch.setenv("VRAMSHARD_CPU_AMX", "off")  # (as beside a GPU: the tiles' rows are packed by none)
    mode = cpu_packed.MODE
    result = pack_ahead.main(["--shape", "tiny-llama", "--layers", "2", "--pieces", "3,5", "--rounds", "2",
                              "--tokens", "3"])
    assert cpu_packed.MODE == mode
    ahead, at_switch = result["rows"]["ahead"], result["rows"]["at_switch"]
    assert len(ahead) == len(at_switch) == 2 and {r["to_pieces"] for r in ahead} == {3, 5}
    assert all(r["switch_packing_s"] == 0 and r["ahead_packing_s"] > 0 for r in ahead)
    assert all(r["switch_packing_s"] > 0 for r in at_switch)


def test_the_budget_followers_plans_are_packed_ahead_before_they_can_come_into_force(tiny_model_dir, monkeypatch):
    """The background re-plan (its quick plan, then its full one) hands each plan to the executor to
    pack ahead before it goes into the plan cache, where the steps' poll finds it; a failure to pack
    ahead leaves the plan to come in as before."""
    from vramshard.runtime import budget as budgets

    # A profile with a GPU on every machine (this machine's had none on the development machine, where the plans
    # were all-CPU and 64 MiB passed; the GPU machines refused 64 MiB, below the workspace's minimum of 147 MiB with
    # the allocator's slack and cuBLAS's workspaces: forty-ninth GPU session).
    profile = Profile.synthetic(cpu_gflops=400, gpu_gflops=50_000, h2d_gbps=20, cpu_mem_gbps=40, gpu_mem_gbps=900)
    engine = Engine.load(tiny_model_dir("llama"), vram="192MiB", simulate_gpu=True, max_context=64, profile=profile)
    follower, seen = engine.budget, []
    budget = follower.watcher.in_force

    def prepare(plans):
        in_cache = [follower._quick_plan_ready(budget, None), follower._full_plan_ready(budget, None)]
        seen.append((plans, in_cache))
        if len(seen) > 2:
            raise RuntimeError("no room")

    monkeypatch.setattr(engine.executor, "prepare", prepare)
    follower.plan_cache = budgets.PlanCache()
    follower._plan_fully(budget, None, quick_first=True)
    assert [cached for _, cached in seen] == [[False, False], [True, False]]  # each before it is cached
    assert all(isinstance(plans, TieredPlacement) for plans, _ in seen)
    assert follower._full_plan_ready(budget, None)
    follower.plan_cache = budgets.PlanCache()
    follower._plan_fully(budget, None)
    assert len(seen) == 3 and follower._full_plan_ready(budget, None)


@needs_mkldnn
def test_packed_parts_take_no_row_major_down_copies_beside_them(tiny_model_dir, monkeypatch):
    """A split FFN's CPU part and an FFN wholly on the CPU, in the split layout (down stored
    transposed): packed, neither gets a row-major down copy, which it would never read."""
    from vramshard.plan.placement import CPU, Placement, split_ffn

    path = tiny_model_dir("llama")
    reference = Engine.load(path, device="cpu")
    expected = trace_logits(reference)
    mixed = Placement("mixed", tuple((s.name, split_ffn(3) if s.name == "ffn[0]" else CPU if s.kind == "ffn"
                                      else _split_placement(reference.model, [3]).as_dict()[s.name])
                                     for s in reference.model))
    for packed in (False, True):
        monkeypatch.setattr(cpu_packed, "MODE", "on" if packed else "off")
        engine = Engine.load(path, placement=mixed, simulate_gpu=True, max_context=64)
        torch.testing.assert_close(trace_logits(engine), expected, rtol=1e-5, atol=1e-5)
        pieces = engine.model["ffn[1]"].num_pieces
        copies, parts = set(engine.executor._down_copies._parts), set(engine.executor._packed._parts)
        if packed:
            assert copies == set() and parts == {("ffn[0]", 3), ("ffn[1]", pieces)}
        else:
            assert copies == {("ffn[0]", 3), ("ffn[1]", pieces)} and parts == set()


@needs_mkldnn
def test_auto_packs_up_to_its_allowance_and_the_parts_beyond_run_plain_with_down_copies(tiny_model_dir,
                                                                                          monkeypatch, caplog):
    """auto (beside a GPU) packs parts while they fit a quarter of the available memory; the part
    that does not fit is computed from the plain weights, its down row-major, and the logits are
    those of the CPU placement either way."""
    import logging

    from vramshard.runtime import host_allowance

    from vramshard.runtime import executor

    path = tiny_model_dir("llama")
    reference = Engine.load(path, device="cpu")
    expected = trace_logits(reference)
    ffn = reference.model["ffn[0]"]
    one = sum(t.nbytes for t in ffn.pieces_of(reference.executor.host["ffn[0]"].views, 0, 5).values())
    monkeypatch.setattr(host_allowance, "available_host_bytes", lambda: int(4 * 1.5 * one))  # room for one part
    monkeypatch.setattr(executor, "PackedParts", lambda gpu: cpu_packed.PackedParts("auto", gpu=True))  # (a real GPU)
    with caplog.at_level(logging.INFO, logger="vramshard.runtime.host_allowance"):
        # (one plan for every step size, packing at all of them: named placements pack where the profile says)
        engine = Engine.load(path, placement=TieredPlacement.single(_split_placement(reference.model, [5, 5])),
                             simulate_gpu=True, max_context=64)
        torch.testing.assert_close(trace_logits(engine), expected, rtol=1e-5, atol=1e-5)
    assert set(engine.executor._packed._parts) == {("ffn[0]", 5)}
    packed = engine.executor._packed
    assert packed._refused == {("ffn[1]", 5)}  # asked again each step, refused without the sums
    packed.keep({("ffn[1]", 5)})  # a plan without ffn[0]'s part: room again for ffn[1]'s
    ffn1 = engine.executor._cpu_part(engine.model["ffn[1]"], 5)
    assert packed._refused == set() and packed.get("ffn[1]", 5, ffn1, 1) is not None
    assert set(engine.executor._down_copies._parts) == {("ffn[1]", 5)}
    assert "prepacked for oneDNN: the copies' " in caplog.text and "VRAMSHARD_CPU_PACKED=on lifts" in caplog.text


@needs_mkldnn
def test_the_few_rows_kernels_of_plain_parts_are_not_compiled_at_load_where_parts_are_packed(tiny_model_dir,
                                                                                              monkeypatch):
    """Prepacked parts run neither the compiled SwiGLU of a few rows nor the one-token projections:
    where the CPU computes only those parts and the embedding (a lookup), an executor that packs
    compiles neither at load (43 s of a 66 s load on the H100 machine); one with an attention on
    the CPU still compiles the projections."""
    from vramshard.layers import cpu_linear, cpu_swiglu
    from vramshard.plan.placement import CPU, Placement

    path = tiny_model_dir("llama", torch.bfloat16)
    reference = Engine.load(path, device="cpu", dtype="float32")
    warmed = []
    monkeypatch.setattr(cpu_swiglu, "warm_up", lambda dtype: warmed.append("swiglu"))
    monkeypatch.setattr(cpu_linear, "warm_up", lambda dtype: warmed.append("linear"))
    split = _split_placement(reference.model, [3, 15])
    attention_on_cpu = Placement("split+attn", tuple((name, CPU if name == "attn[1]" else where)
                                                     for name, where in split.as_dict().items()))
    for mode, placement, compiled in (("off", split, {"swiglu", "linear"}), ("on", split, set()),
                                      ("on", attention_on_cpu, {"linear"})):
        monkeypatch.setattr(cpu_packed, "MODE", mode)
        warmed.clear()
        Engine.load(path, placement=TieredPlacement.single(placement), simulate_gpu=True, max_context=64)
        assert set(warmed) == compiled, (mode, placement.name)


@needs_mkldnn
def test_only_decode_sized_steps_read_packed_parts_and_onednn_is_asked_to_compute_once(monkeypatch):
    """A part asked for at more than DECODE_ROWS rows (a prompt chunk) is not packed: None, nothing
    kept. Decode-sized ones are packed on first use, and oneDNN computes once, with one row, after
    the first part only (a CPU that cannot run the dtype fails there)."""
    from vramshard.profile.query import DECODE_ROWS

    ffn, weights = _ffn(torch.bfloat16)
    whole = _whole(ffn, weights)
    computed = []
    real_contribution = cpu_packed.PackedPart.contribution
    monkeypatch.setattr(cpu_packed.PackedPart, "contribution",
                        lambda self, h: computed.append(h.shape[0]) or real_contribution(self, h))
    packed = cpu_packed.PackedParts("on")
    assert packed.get("ffn[0]", 3, ffn.pieces_of(whole, 0, 3), DECODE_ROWS + 1) is None
    assert packed._parts == {} and packed.nbytes == 0 and packed.packing_s == 0
    for pieces in (3, 4):
        assert packed.get("ffn[0]", pieces, ffn.pieces_of(whole, 0, pieces), DECODE_ROWS) is not None
    assert set(packed._parts) == {("ffn[0]", 3), ("ffn[0]", 4)} and computed == [1]
    h = torch.randn(DECODE_ROWS + 1, ffn.hidden).to(torch.bfloat16)  # a packed part serves every row count
    part = ffn.pieces_of(whole, 0, 3)
    expected = swiglu(h.float(), part["gate_proj"].float(), part["up_proj"].float(), part["down_proj"].float())
    got = packed._parts["ffn[0]", 3].contribution(h).float()
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())


@needs_mkldnn
def test_a_prompt_chunk_computes_its_parts_plain_with_down_copies_where_decode_steps_read_them_packed(
        tiny_model_dir, monkeypatch):
    """A prompt chunk of more than DECODE_ROWS rows through split FFNs whose parts are packed: the
    chunk computes them from the plain weights with their row-major down copies (no packing in the
    step: on the GPU machine that cost a 1K prompt 2.31 s against a 0.20 s bound), decode-sized
    steps from the packed parts; the logits are the CPU placement's."""
    from vramshard.layers import cpu_gemv
    from vramshard.profile.query import DECODE_ROWS

    path = tiny_model_dir("llama")
    prompt = [(5 * i + 1) % 90 for i in range(DECODE_ROWS + 16)]
    reference = Engine.load(path, device="cpu")
    expected = trace_logits(reference, prompt=prompt)
    monkeypatch.setattr(cpu_packed, "MODE", "on")
    monkeypatch.setattr(cpu_gemv, "computes", lambda rows: False)  # one row through the packed parts too
    split = Engine.load(path, placement=_split_placement(reference.model, [3, 15]), simulate_gpu=True,
                        max_context=128)
    used = []
    real_contribution = cpu_packed.PackedPart.contribution
    monkeypatch.setattr(cpu_packed.PackedPart, "contribution",
                        lambda self, h: used.append(h.shape[0]) or real_contribution(self, h))
    torch.testing.assert_close(trace_logits(split, prompt=prompt), expected, rtol=1e-5, atol=1e-5)
    assert len(prompt) not in used and 1 in used
    assert set(split.executor._down_copies._parts) == {("ffn[0]", 3), ("ffn[1]", 15)}


@needs_mkldnn
def test_a_plan_packs_only_at_the_tiers_it_says_and_computes_the_others_plain(tiny_model_dir, monkeypatch):
    """A tiered plan that packs at some decode-sized tiers and not at others: the tier the plan packs
    at reads parts packed when the plans were taken (nothing packed in a step), the tier it does not
    computes plain parts with their row-major down copies; both give the CPU placement's logits."""
    from vramshard.layers import cpu_gemv

    path = tiny_model_dir("llama")
    reference = Engine.load(path, device="cpu")
    expected = trace_logits(reference)  # (a prompt of up to 16 rows, then one-row steps)
    monkeypatch.setattr(cpu_packed, "MODE", "on")
    monkeypatch.setattr(cpu_gemv, "computes", lambda rows: False)  # one row through packed or plain parts
    split = _split_placement(reference.model, [3, 15])
    for packed, kept in (((False, True), {("ffn[0]", 3), ("ffn[1]", 15)}), ((False, False), set())):
        plans = TieredPlacement((1, 16), (split, split), (None, None), packed=packed)
        engine = Engine.load(path, placement=plans, simulate_gpu=True, max_context=64)
        assert set(engine.executor._packed._parts) == kept  # packed when the plans were taken
        spent = engine.executor._packed.packing_s
        used = []
        real_contribution = cpu_packed.PackedPart.contribution
        monkeypatch.setattr(cpu_packed.PackedPart, "contribution",
                            lambda self, h: used.append(h.shape[0]) or real_contribution(self, h))
        torch.testing.assert_close(trace_logits(engine), expected, rtol=1e-5, atol=1e-5)
        monkeypatch.setattr(cpu_packed.PackedPart, "contribution", real_contribution)
        assert set(engine.executor._packed._parts) == kept and engine.executor._packed.packing_s == spent
        assert 1 not in used and (len(PROMPT) in used) == packed[1]  # (the one-row steps read plain parts)
        assert set(engine.executor._down_copies._parts) == {("ffn[0]", 3), ("ffn[1]", 15)}
