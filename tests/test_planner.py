"""Planner on synthetic profiles: tiers, budget arithmetic, pinned set, families, ranking."""

import pytest

from vramshard.errors import BudgetError, InvalidInputError
from vramshard.plan.memory import tiered_vram_need
from vramshard.plan.planner import FAMILIES, Planner
from vramshard.plan.tiers import Tiers
from vramshard.profile.query import synthetic
from vramshard.shapes import shape_model

GiB = 2**30
NEMO = shape_model("nemo-8b")
# A client-like machine: 16-core CPU, PCIe Gen5, a fast GPU.
CLIENT = dict(cpu_gflops=1500, gpu_gflops=200_000, h2d_gbps=50, cpu_mem_gbps=80, gpu_mem_gbps=1500)
TIERS = Tiers((1, 16, 64, 512))


def plan(budget, tiers=TIERS, **profile):
    return Planner(NEMO, synthetic(**{**CLIENT, **profile}), budget, context=1024, tiers=tiers).plan()


def test_tier_selection():
    tiers = Tiers()
    assert tiers.sizes == (1, 4, 16, 64, 256, 512, 1024, 2048)
    assert [tiers.tier_for(n) for n in (1, 2, 4, 5, 64, 65, 2048)] == [1, 4, 4, 16, 64, 256, 2048]
    with pytest.raises(InvalidInputError, match="larger than the largest tier"):
        tiers.tier_for(2049)
    assert Tiers.parse("64, 1,16").sizes == (1, 16, 64)
    with pytest.raises(InvalidInputError):
        Tiers((4, 1))


@pytest.mark.parametrize("budget_gib", [2, 4, 8, 12])
def test_pinned_set_and_total_within_budget(budget_gib):
    result = plan(budget_gib * GiB)
    assert result.need.total <= budget_gib * GiB
    need = tiered_vram_need(NEMO, result.tiered(), 1, 1024, TIERS.largest)
    assert need.resident == result.need.resident
    assert set(result.pinned) == set(result.tiered().placements[0].names(home="vram"))
    assert [r.name for r in result.reasons] and all(r.score > 0 for r in result.reasons)


def test_the_kv_reservation_rounds_each_sequence_up_to_whole_blocks():
    """The paged cache gives each sequence whole blocks: 64 sequences of 88 tokens take 64 x 96
    positions. The planner reserved 64 x 88, so a batch plan that filled its budget to the byte
    needed 48 MiB more once built (qwen3-30b-a3b at 2 GiB, found when the launch price changed)."""
    planner = Planner(NEMO, synthetic(**CLIENT), 4 * GiB, context=88, tiers=Tiers((1, 64)), kv_slots=64, kv_on_gpu=True)
    result = planner.plan()
    need = tiered_vram_need(NEMO, result.tiered(), 64, 88, 64)
    assert result.need.kv == need.kv == planner.kv_bytes()
    a = NEMO.args
    assert planner.kv_bytes() == 2 * a.num_hidden_layers * 64 * 96 * a.num_key_value_heads * a.head_dim * 2
    assert need.total <= 4 * GiB


def test_more_budget_pins_more():
    pinned = [plan(b * GiB).need.resident for b in (2, 4, 8, 12)]
    assert pinned == sorted(pinned) and pinned[-1] > pinned[0]


def test_budget_below_minimum_says_the_minimum():
    with pytest.raises(BudgetError, match=r"below the minimum of .* raise --vram to at least"):
        plan(256 * 2**20)


def test_everything_fits_means_all_resident():
    result = plan(40 * GiB)
    assert len(result.pinned) == len(NEMO) and result.need.slots == 0
    assert all(p.family for p in result.tiers.values())


def test_a_budget_just_short_of_every_weight_pins_instead_of_streaming_through_slots():
    # Every sub-layer but the embedding (which the CPU looks up) fits beside the KV cache and the
    # workspace, but not beside two streaming slots as well: the plan without slots pins them all.
    # Planned with slots, it streamed two FFNs through 2 x 270 MiB of slots (docs/BENCHMARKS.md,
    # eighteenth GPU session: 41 against 18 ms per step at 16 GiB and 5K context).
    sizes = {s.name: s.nbytes for s in NEMO}
    probe = Planner(NEMO, synthetic(**CLIENT), None, context=1024, tiers=TIERS)
    rest = probe.kv_bytes() + tiered_vram_need(NEMO, plan(40 * GiB).tiered(), 1, 1024, TIERS.largest).workspace
    but_embedding = sum(n for name, n in sizes.items() if name != "embed")
    budget = but_embedding + rest + 64 * 2**20  # less than the 540 MiB two slots need
    result = plan(budget)
    assert result.need.slots == 0 and result.need.total <= budget
    assert set(result.pinned) == set(sizes) - {"embed"}
    assert not any(p.placement.names(home="stream") for p in result.tiers.values())
    assert any("no streaming slots" in note for note in result.notes)


def test_a_budget_well_short_of_the_weights_still_streams():
    result = plan(8 * GiB)
    assert result.need.slots > 0 and not any("no streaming slots" in note for note in result.notes)
    assert any(p.placement.names(home="stream") for p in result.tiers.values())


def test_no_gpu_plan_is_all_cpu_and_said_plainly():
    result = Planner(NEMO, synthetic(cpu_gflops=1000), 4 * GiB, context=1024, tiers=TIERS).plan()
    assert all(p.placement.name == "cpu" and not p.placement.uses_gpu for p in result.tiers.values())
    assert any("no GPU" in note for note in result.notes)


def test_every_family_is_generated_for_every_tier():
    result = plan(4 * GiB)
    for tier_plan in result.tiers.values():
        assert set(tier_plan.candidates) == set(FAMILIES)
        assert tier_plan.predicted_s == min(tier_plan.candidates.values())


def test_fast_pcie_favours_streaming_slow_pcie_favours_cpu():
    fast = plan(4 * GiB, h2d_gbps=500, cpu_gflops=200, cpu_mem_gbps=20)
    slow = plan(4 * GiB, h2d_gbps=1, cpu_gflops=5000, cpu_mem_gbps=300)
    # With PCIe 10x the CPU, decode streams; with PCIe starved, it keeps the free weights on the CPU.
    assert fast.tiers[1].candidates["gpu-only"] < fast.tiers[1].candidates["cpu"]
    assert slow.tiers[1].candidates["cpu"] < slow.tiers[1].candidates["gpu-only"]
    assert len(fast.tiers[1].placement.names(home="stream")) > len(slow.tiers[1].placement.names(home="stream"))


def test_prompt_tiers_stream_more_than_decode():
    result = plan(4 * GiB)
    decode = len(result.tiers[1].placement.names(home="stream"))
    prompt = len(result.tiers[512].placement.names(home="stream"))
    assert prompt >= decode
    assert result.tiers[512].candidates["gpu-only"] < result.tiers[512].candidates["cpu"]


def test_dynamic_balances_pcie_and_cpu():
    result = plan(2 * GiB)
    dynamic = result.tiers[1].candidates["dynamic"]
    assert dynamic <= result.tiers[1].candidates["gpu-only"]
    assert dynamic <= result.tiers[1].candidates["cpu"]


def test_plan_set_is_plain_data():
    import json

    data = plan(4 * GiB).to_dict()
    text = json.dumps(data)
    assert json.loads(text)["tiers"]["1"]["family"] in FAMILIES
    from vramshard.plan.placement import TieredPlacement

    tiered = plan(4 * GiB).tiered()
    assert TieredPlacement.from_json(tiered.to_json()) == tiered


def test_pinned_set_takes_the_faster_of_the_two_greedy_orders():
    """With the KV cache in VRAM, attention left out can only stream, while an FFN left out can
    also run on the CPU: pinning attention first frees the copy engine for FFNs. The planner
    compares both orders and must keep the one its estimator predicts faster."""
    profile = synthetic(**{**CLIENT, "cpu_mem_gbps": 50})  # a CPU slow enough that FFNs score first
    planner = Planner(NEMO, profile, 8 * GiB, context=1024, tiers=TIERS, kv_on_gpu=True)
    result = planner.plan()
    room = 8 * GiB - result.need.workspace - result.need.kv - result.need.slots

    def predicted(pinned):
        return sum(planner._plan_tier(t, set(pinned), True, search=False).predicted_s / t for t in TIERS.sizes)

    orders = [planner._pinned_set(room, True, fixed_first=first)[0] for first in (False, True)]
    assert orders[0] != orders[1]  # the two orders differ here, so the choice means something
    assert predicted(result.pinned) <= min(predicted(p) for p in orders) * 1.0001
    assert predicted(orders[1]) < predicted(orders[0])  # and here attention first is the faster one
    assert set(result.pinned) == set(orders[1])
    attention = [n for n in orders[1] if n.startswith("attn")]
    assert len(attention) == NEMO.args.num_hidden_layers  # attention first: all of it fits in 8 GiB


def test_plan_picture_colours_splits_and_host_kv_attention(tmp_path):
    from vramshard.plan.placement import CPU, GPU_RESIDENT, GPU_STREAMED, GPU_STREAMED_HOST_KV, split_ffn
    from vramshard.plan.report import category, plot_plan

    assert [category(w) for w in (CPU, GPU_RESIDENT, GPU_STREAMED, GPU_STREAMED_HOST_KV, split_ffn(4))] == \
        ["host", "vram", "stream", "kv@host", "split"]
    result = plan(2 * GiB, cpu_mem_gbps=50)
    plot_plan(result, tmp_path / "plan.png")
    assert (tmp_path / "plan.png").stat().st_size > 10_000


def test_cpu_attention_of_a_decode_batch_counts_gathering_its_keys():
    """Several sequences decoding at once on the CPU without the C kernel gather their cached keys and values
    into one batch first: that costs in proportion to the context; one token or a prompt chunk does not."""
    from vramshard.plan.estimator import Estimator

    profile = synthetic(**CLIENT)
    estimator = Estimator(NEMO, profile, cpu_gemv=False)
    attn = next(s for s in NEMO if s.kind == "attn")

    def extra(tokens, context):
        alone = profile.attention_s(tokens, context, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                    NEMO.dtype, "cpu")
        matmuls = sum(estimator._matmul(m, k, n, "cpu", False) for m, k, n in attn.matmuls(tokens))
        return estimator.compute_s(attn, "cpu", tokens, context) - alone - matmuls

    per_token = attn.kv_bytes_per_token(NEMO.dtype)
    assert extra(16, 4096) == pytest.approx(profile.host_gather_s(4096 * per_token), rel=1e-6)
    assert extra(16, 8192) == pytest.approx(2 * extra(16, 4096), rel=1e-6)
    assert extra(1, 4096) == pytest.approx(0, abs=1e-9) and extra(512, 4096) == pytest.approx(0, abs=1e-9)
    assert estimator.compute_s(attn, "cuda", 16, 4096) < estimator.compute_s(attn, "cpu", 16, 4096)


def test_a_named_placement_packs_only_at_the_tiers_where_the_profile_finds_packed_weights_faster(tiny_model_dir):
    """A named placement (``layers:N``, or a Placement given) beside a GPU runs the same sub-layers on the
    same side at every step size, but reads dense FFNs' CPU work prepacked only at the tiers a plan would
    (``Estimator.packs_at``), not at every one: its name stays; ``VRAMSHARD_CPU_PACKED=on`` packs at every
    decode-sized tier."""
    from vramshard import Engine
    from vramshard.plan.mechanisms import Mechanisms, fixed_mechanisms
    from vramshard.plan.placement import named_placement
    from vramshard.plan.planner import named_plan
    from vramshard.plan.memory import sublayer_triples
    from vramshard.profile.query import Profile
    from vramshard.profile.synthetic import synthetic_data
    from vramshard.runtime import cpu_packed

    data = synthetic_data(**CLIENT)
    data["packed_ffn"] = {name: {"1": 0.7, "16": 0.8, "64": 1.05} for name in ("fp16", "fp32")}
    profile = Profile(data)
    tiers = Tiers((1, 4, 16, 64, 256))
    layers = named_placement("layers:10", sublayer_triples(NEMO), NEMO.args.num_hidden_layers)
    packing = Mechanisms(run_ahead=False, cpu_packed=True, cpu_gemv=True, zero_copy=(False, 0))
    with fixed_mechanisms(packing):
        tiered = named_plan(NEMO, layers, profile, tiers)
    assert tiered.tiers == tiers.sizes and all(p is layers for p in tiered.placements) and tiered.name == "layers:10"
    assert tiered.packed == (False, False, True, False, False)  # (up to four rows: the C kernel; 64: not faster)
    with fixed_mechanisms(Mechanisms(run_ahead=False, cpu_packed=False, cpu_gemv=True, zero_copy=(False, 0))):
        assert not any(named_plan(NEMO, layers, profile, tiers).packed)  # (the executor packs nothing)

    path = tiny_model_dir("llama")
    with fixed_mechanisms(packing):
        engine = Engine.load(path, placement="layers:1", vram="1GiB", simulate_gpu=True, max_context=64,
                             profile=profile)
    plans = engine.executor.plans
    assert plans.name == engine.executor.placement.name == "layers:1" and len(set(plans.placements)) == 1
    assert [plans.packs(n) for n in (1, 3, 16, 40, 300)] == [False, False, True, False, False]
    saved = cpu_packed.MODE
    try:
        cpu_packed.MODE = "on"
        forced = named_plan(NEMO, layers, profile, tiers)
    finally:
        cpu_packed.MODE = saved
    assert forced.packed[2:] == (True, True, False)  # (and at one and four rows where the kernel does not build)


def test_a_few_rows_of_dense_ffn_work_on_the_cpu_are_priced_as_the_kernel_reads_them():
    """Up to FFN_ROWS rows of a dense FFN on the CPU (whole, or a split part) go through the C kernel, which
    reads each weight row once for all of them: where the profile's one-row tables went through it, those
    rows are priced as one row; more rows, a profile timed otherwise, or no kernel keep the tables' rows."""
    from vramshard.layers import cpu_gemv
    from vramshard.plan.estimator import Estimator
    from vramshard.plan.mechanisms import Mechanisms, fixed_mechanisms
    from vramshard.profile.query import Profile
    from vramshard.profile.synthetic import synthetic_data

    data = synthetic_data(**{**CLIENT, "cpu_gflops": 100})  # (slow arithmetic: more rows cost more in the tables)
    timed_by_kernel = Profile({**data, "cpu_gemv": "AVX-512 with AVX512-BF16"})
    ffn = NEMO["ffn[0]"]
    rows = cpu_gemv.FFN_ROWS
    mechanisms = Mechanisms(run_ahead=False, cpu_packed=False, cpu_gemv=True, zero_copy=(False, 0))
    with fixed_mechanisms(mechanisms):
        est = Estimator(NEMO, timed_by_kernel)
        assert est.compute_s(ffn, "cpu", rows, 1024) == pytest.approx(est.compute_s(ffn, "cpu", 1, 1024))
        assert est.part_s(ffn, "cpu", rows, 0, 5) == pytest.approx(est.part_s(ffn, "cpu", 1, 0, 5))
        assert est.compute_s(ffn, "cpu", rows + 1, 1024) > 1.2 * est.compute_s(ffn, "cpu", 1, 1024)
        tables = Estimator(NEMO, Profile(data))  # (its one-row tables timed torch's paths)
        assert tables.compute_s(ffn, "cpu", rows, 1024) > 1.2 * tables.compute_s(ffn, "cpu", 1, 1024)
    with fixed_mechanisms(Mechanisms(run_ahead=False, cpu_packed=False, cpu_gemv=False, zero_copy=(False, 0))):
        est = Estimator(NEMO, timed_by_kernel)
        assert est.compute_s(ffn, "cpu", rows, 1024) > 1.2 * est.compute_s(ffn, "cpu", 1, 1024)


def test_tiers_pack_the_cpu_work_only_where_the_profile_finds_packed_weights_faster():
    """Each tier's plan says whether its dense FFNs' CPU work reads weights prepacked for oneDNN: only
    decode-sized tiers where the profile's packed factor is below PACK_GAIN (not at the few rows the
    C kernel computes); the estimator prices the tier as it says, and the flags reach the placement."""
    from vramshard.plan.estimator import PACK_GAIN, Estimator
    from vramshard.plan.mechanisms import Mechanisms, fixed_mechanisms
    from vramshard.plan.placement import TieredPlacement
    from vramshard.profile.query import Profile
    from vramshard.profile.synthetic import synthetic_data

    data = synthetic_data(**CLIENT)
    data["packed_ffn"] = {"fp16": {"1": 0.7, "16": 0.8, "64": 1.05}}  # (nemo-8b is fp16)
    profile = Profile(data)
    gemv = Mechanisms(run_ahead=False, cpu_packed=True, cpu_gemv=True, zero_copy=(False, 0))
    with fixed_mechanisms(gemv):
        est = Estimator(NEMO, profile)
        assert [est.packs_at(rows) for rows in (1, 4, 8, 16, 64, 256)] == [False, False, True, True, False, False]
        assert profile.packed_ffn_factor(NEMO.dtype, 64) >= PACK_GAIN
        plan = Planner(NEMO, profile, 4 * GiB, context=1024, tiers=Tiers((1, 16, 64, 512))).plan()
    assert [plan.tiers[t].cpu_packed for t in (1, 16, 64, 512)] == [False, True, False, False]
    tiered = plan.tiered()
    assert tiered.packed == (False, True, False, False) and [tiered.packs(n) for n in (1, 9, 40, 300)] == \
        [False, True, False, False]
    assert TieredPlacement.from_json(tiered.to_json()).packed == tiered.packed
    from rich.console import Console

    from vramshard.plan.report import print_plan

    console = Console(record=True, width=200)
    print_plan(plan, console)
    assert "prepacked for oneDNN at tier(s) 16 (" in console.export_text()
    with fixed_mechanisms(Mechanisms(run_ahead=False, cpu_packed=False, cpu_gemv=True, zero_copy=(False, 0))):
        unpacked = Planner(NEMO, profile, 4 * GiB, context=1024, tiers=Tiers((1, 16, 64, 512))).plan()
    assert not any(t.cpu_packed for t in unpacked.tiers.values())  # (the executor packs nothing: none planned)
    with pytest.raises(InvalidInputError, match="packed flags"):
        TieredPlacement(tiered.tiers, tiered.placements, tiered.threads, packed=(True,))


def test_a_long_context_keeps_the_kv_cache_of_pinned_attention_in_vram_and_the_rest_in_host_memory(monkeypatch):
    """At 32K tokens nemo-8b's KV cache (5 GiB) does not fit a 4 GiB budget: the planner's third KV variant
    keeps the caches of the attention layers it pins in VRAM beside them (as llama.cpp's -ngl keeps those of
    the layers it offloads) and the others' in host memory, their attention on the CPU or staged, each
    pinned layer's cache counted against the budget; predicted faster than all of it in host memory.
    (VRAMSHARD_KV_SPLIT=on; off, the planner keeps the cache whole.) Without the C kernel: with it the CPU attends
    a decode batch sequence by sequence, cheaply enough that this profile's planner pins no attention (session 63)."""
    from vramshard.plan import planner as planning

    monkeypatch.setenv("VRAMSHARD_CPU_GEMV", "off")
    profile, budget, context = synthetic(**CLIENT), 4 * GiB, 32768
    monkeypatch.setattr(planning, "KV_SPLIT", False)
    assert Planner(NEMO, profile, budget, context=context, tiers=TIERS).plan().kv_layers_in_vram is None
    monkeypatch.setattr(planning, "KV_SPLIT", True)
    planner = Planner(NEMO, profile, budget, context=context, tiers=TIERS)
    result = planner.plan()
    attention = {s.name for s in NEMO if s.kind == "attn"}
    pinned = attention & set(result.pinned)
    assert result.kv_layers_in_vram == len(pinned) > 0 and result.kv_on_gpu, result.notes
    assert f"in VRAM for the {len(pinned)} attention layers pinned there" in result.kv_side
    need = tiered_vram_need(NEMO, result.tiered(), 1, context, TIERS.largest)
    assert result.need.kv == need.kv == len(pinned) * planner.layer_kv_bytes()
    assert result.need.total <= budget
    for tier in result.tiers.values():
        homes = {name: where.kv_in_vram for name, where in tier.placement.where if name in attention}
        assert {name for name, in_vram in homes.items() if in_vram} == pinned
    host = Planner(NEMO, profile, budget, context=context, tiers=TIERS, kv_on_gpu=False).plan()
    assert host.kv_layers_in_vram is None and host.need.kv == 0
    assert result.tiers[1].predicted_s < host.tiers[1].predicted_s
