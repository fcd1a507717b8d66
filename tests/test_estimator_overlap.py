"""The estimator's CPU work beside the copy engine: the contended pace only while copies run."""

import pytest
import torch

from vramshard.plan.estimator import CopyEngineSpans, Estimator
from vramshard.plan.placement import CPU, GPU_RESIDENT, GPU_STREAMED, Placement, Where
from vramshard.profile.query import synthetic
from vramshard.shapes import shape_model

NEMO = shape_model("nemo-8b")
CLIENT = dict(cpu_gflops=1500, gpu_gflops=200_000, h2d_gbps=50, cpu_mem_gbps=80, gpu_mem_gbps=1500)


def spans(*intervals):
    return CopyEngineSpans([(f"w{i}", "copy", a, b) for i, (a, b) in enumerate(intervals)])


def test_cpu_work_is_slowed_only_where_a_copy_runs():
    # 1 s of work alone, 3 s beside copies.
    assert spans().cpu_end(0.0, 1.0, 3.0) == pytest.approx(1.0)  # no copies at all
    assert spans((5.0, 6.0)).cpu_end(0.0, 1.0, 3.0) == pytest.approx(1.0)  # the copy comes after
    assert spans((0.0, 10.0)).cpu_end(0.0, 1.0, 3.0) == pytest.approx(3.0)  # copies all along
    # 0.6 s of copies first: 0.2 of the work done by then, 0.8 left alone.
    assert spans((0.0, 0.6)).cpu_end(0.0, 1.0, 3.0) == pytest.approx(1.4)
    # Alone until 0.5, beside a copy until 0.8 (0.1 of the work), then alone: 0.5 + 0.3 + 0.4.
    assert spans((0.5, 0.8)).cpu_end(0.0, 1.0, 3.0) == pytest.approx(1.2)
    # Copies that ended before the work starts change nothing.
    assert spans((0.0, 1.0)).cpu_end(2.0, 1.0, 3.0) == pytest.approx(3.0)
    # No contention measured: the work takes its own time.
    assert spans((0.0, 10.0)).cpu_end(0.0, 1.0, 1.0) == pytest.approx(1.0)


def test_cpu_work_asked_in_time_order_sees_copies_issued_meanwhile():
    timeline = []
    copies = CopyEngineSpans(timeline)
    assert copies.cpu_end(0.0, 1.0, 2.0) == pytest.approx(1.0)
    timeline.append(("attn", "gpu", 1.0, 1.1))  # not a copy: ignored
    timeline.append(("ffn", "copy", 1.0, 3.0))
    assert copies.cpu_end(1.5, 1.0, 2.0) == pytest.approx(3.25)  # 1.5 s beside the copy does 0.75
    assert copies.cpu_end(4.0, 1.0, 2.0) == pytest.approx(5.0)


def cpu_placement(attention: Where) -> Placement:
    """Every FFN on the CPU, every attention ``attention``, the head resident."""
    where = []
    for s in NEMO:
        if s.kind == "ffn" or s.kind == "embed":
            where.append((s.name, CPU))
        elif s.kind == "attn":
            where.append((s.name, attention))
        else:
            where.append((s.name, GPU_RESIDENT))
    return Placement("test", tuple(where))


def test_a_step_is_slower_the_more_its_cpu_work_overlaps_copies():
    """With a profile whose CPU is 3x slower beside PCIe, CPU FFNs beside streamed attention cost
    more than beside resident attention, but less than if all their time were contended."""
    slowed = synthetic(**CLIENT, cpu_contention=3.0)
    estimator = Estimator(NEMO, slowed)
    resident = estimator.simulate(cpu_placement(GPU_RESIDENT), 1, 1024)
    streamed = estimator.simulate(cpu_placement(GPU_STREAMED), 1, 1024)
    ffns = [s for s in NEMO if s.kind in ("ffn", "embed")]  # what the placement runs on the CPU
    alone = sum(estimator.compute_s(s, "cpu", 1, 1024) for s in ffns)
    contended = sum(estimator.compute_s(s, "cpu", 1, 1024, contended=True) for s in ffns)
    assert contended == pytest.approx(3 * alone, rel=1e-4)
    assert resident.cpu_busy == pytest.approx(alone + sum(estimator.launch_s(s, "cpu", 1) for s in ffns), rel=1e-6)
    assert alone < streamed.cpu_busy - (resident.cpu_busy - alone) < contended
    # Without contention in the profile, streaming beside the CPU work costs it nothing.
    plain = Estimator(NEMO, synthetic(**CLIENT, cpu_contention=1.0))
    assert plain.simulate(cpu_placement(GPU_STREAMED), 1, 1024).cpu_busy == \
        pytest.approx(plain.simulate(cpu_placement(GPU_RESIDENT), 1, 1024).cpu_busy, rel=1e-4)


def test_a_cached_moe_decode_step_pays_the_hosts_calls_per_miss():
    """A gathered MoE decode step over the expert cache: with PCIe so fast that the copies cost
    nothing, each miss still costs the host its copy-issuing calls at the dispatch rate."""
    from vramshard.plan.estimator import COPY_ISSUE_CALLS, DISPATCH_LAUNCHES
    from vramshard.plan.memory import moe_layers, sublayer_triples
    from vramshard.plan.placement import named_placement

    model = shape_model("qwen3-30b-a3b")
    profile = synthetic(**{**CLIENT, "h2d_gbps": 1e6}, dispatch_us={"cpu": 20, "cuda": 100})
    placement = named_placement("experts-stream", sublayer_triples(model), model.args.num_hidden_layers,
                                moe_layers=moe_layers(model))
    all_hit = Estimator(model, profile, expert_hit_rate=1.0).simulate(placement, 1, 1024).seconds
    all_miss = Estimator(model, profile, expert_hit_rate=0.0).simulate(placement, 1, 1024).seconds
    layers = len(moe_layers(model))
    touched = model["ffn[0]"].expected_experts_touched(1)
    calls = layers * touched * COPY_ISSUE_CALLS
    assert all_miss - all_hit == pytest.approx(calls * 100e-6 / DISPATCH_LAUNCHES, rel=0.05)


def split_placement(cpu_pieces: int) -> Placement:
    """Every dense FFN split (its first ``cpu_pieces`` pieces on the CPU, the rest streamed),
    attention and head resident, the embedding on the CPU."""
    from vramshard.plan.placement import split_ffn

    where = [(s.name, split_ffn(cpu_pieces) if s.kind == "ffn" else CPU if s.kind == "embed" else GPU_RESIDENT)
             for s in NEMO]
    return Placement("split", tuple(where))


@pytest.mark.parametrize("rows", [1, 64])
def test_run_ahead_takes_the_hosts_launches_off_a_split_step_but_not_below_its_resources(rows):
    """With the split FFNs' CPU parts on the run-ahead worker, the host thread's launches overlap
    the CPU parts: the step is shorter by at most those launches, never shorter than the CPU's or
    the copy engine's busy time, and the same CPU and copy work is done."""
    from vramshard.plan.estimator import AHEAD_LAUNCHES, DISPATCH_LAUNCHES, PART_LAUNCHES

    profile = synthetic(**CLIENT, dispatch_us={"cpu": 20, "cuda": 400})
    placement = split_placement(8)
    estimator = Estimator(NEMO, profile, run_ahead=False)
    plain = estimator.simulate(placement, rows, 1024)
    ahead = Estimator(NEMO, profile, run_ahead=True).simulate(placement, rows, 1024)
    splits = len(placement.split_names())
    # The host's launches a step, the two copies it issues for each split (h out, the part back) and its fills.
    fills = sum(estimator.fill_issue_s(NEMO[name], placement[name]) for name in placement.split_names())
    launches = splits * (PART_LAUNCHES * 400e-6 / DISPATCH_LAUNCHES + 2 * 400e-6) + fills + sum(
        estimator.launch_s(s, "cuda", rows) for s in NEMO if s.kind not in ("ffn", "embed"))
    assert ahead.cpu_busy == pytest.approx(plain.cpu_busy, rel=0.05)
    assert ahead.copy_busy == pytest.approx(plain.copy_busy, rel=1e-6)
    assert max(ahead.cpu_busy, ahead.copy_busy) <= ahead.seconds * (1 + 1e-9) and ahead.seconds < plain.seconds
    assert plain.seconds - ahead.seconds <= launches
    # With free launches there is nothing for the worker to hide but the host's own waits.
    free = synthetic(**CLIENT, dispatch_us={"cpu": 0.01, "cuda": 0.01})
    plain_free = Estimator(NEMO, free, run_ahead=False).simulate(placement, rows, 1024).seconds
    ahead_free = Estimator(NEMO, free, run_ahead=True).simulate(placement, rows, 1024).seconds
    assert ahead_free == pytest.approx(plain_free, rel=0.1)
    assert Estimator(NEMO, profile).run_ahead is False  # as the executor runs here (no GPU, or off)
    assert AHEAD_LAUNCHES > 0


def test_bound_run_ahead_prices_only_parts_the_c_kernel_computes_on_the_worker():
    """VRAMSHARD_RUN_AHEAD=bound: a split FFN's CPU part goes to the worker where it runs as one bound C call (up
    to the C kernel's rows, half precision): priced as ``run_ahead_dense`` prices it there, as the host thread's
    elsewhere; without the C kernel, nowhere."""
    from vramshard.layers import cpu_gemv

    profile = synthetic(**CLIENT, dispatch_us={"cpu": 20, "cuda": 400})
    placement = split_placement(8)
    model = NEMO

    def step(rows, **switches):
        return Estimator(model, profile, run_ahead=False, cpu_gemv=True, **switches).simulate(placement, rows, 1024)

    assert model.dtype in (torch.bfloat16, torch.float16)
    few, many = 1, cpu_gemv.FFN_ROWS + 1
    for rows, on_worker in ((few, True), (many, False)):
        bound = step(rows, run_ahead_bound=True)
        worker, host = step(rows, run_ahead_dense=True), step(rows)
        assert bound.seconds == pytest.approx((worker if on_worker else host).seconds, rel=1e-9)
        assert worker.seconds != pytest.approx(host.seconds, rel=1e-3)  # (the check can fail)
    no_kernel = Estimator(model, profile, run_ahead=False, cpu_gemv=False, run_ahead_bound=True)
    assert no_kernel.simulate(placement, few, 1024).seconds == pytest.approx(
        Estimator(model, profile, run_ahead=False, cpu_gemv=False).simulate(placement, few, 1024).seconds, rel=1e-9)


def test_run_ahead_moe_experts_on_the_cpu_overlap_the_hosts_launches():
    """Experts on the CPU (``experts-cpu``) on the run-ahead worker: the host neither waits for
    each router nor computes the experts, so the step is shorter, by no more than its launches
    and crossings, and no shorter than the experts' CPU time."""
    from vramshard.plan.memory import moe_layers, sublayer_triples
    from vramshard.plan.placement import named_placement

    model = shape_model("qwen3-30b-a3b")
    profile = synthetic(**CLIENT, dispatch_us={"cpu": 20, "cuda": 400})
    placement = named_placement("experts-cpu", sublayer_triples(model), model.args.num_hidden_layers,
                                moe_layers=moe_layers(model))
    plain = Estimator(model, profile, run_ahead=False).simulate(placement, 1, 1024)
    ahead = Estimator(model, profile, run_ahead=True).simulate(placement, 1, 1024)
    assert ahead.cpu_busy == pytest.approx(plain.cpu_busy, rel=0.05)
    assert ahead.cpu_busy <= ahead.seconds < plain.seconds


def test_zero_copy_experts_are_read_over_the_link_not_computed_on_the_cpu():
    """Experts in host memory read by the GPU (``VRAMSHARD_EXPERTS_ZERO_COPY``): at decode the step
    spends no CPU time on them and takes at least the routed experts' bytes over PCIe; the CPU
    path's step is the shorter one only where the CPU outruns the link; past the kernels' rows
    the experts go to the CPU as before."""
    from vramshard.plan.estimator import ZERO_COPY_EFFICIENCY
    from vramshard.plan.memory import moe_layers, sublayer_triples
    from vramshard.plan.placement import named_placement

    model = shape_model("qwen3-30b-a3b")
    moe = [s for s in model if s.name.startswith("ffn")]
    placement = named_placement("experts-cpu", sublayer_triples(model), model.args.num_hidden_layers,
                                moe_layers=moe_layers(model))
    routed = sum(s.top_k * s.expert_bytes for s in moe)  # one token's expert reads, every layer
    for cpu_gflops, cpu_mem_gbps, faster in ((1500, 20, "zero_copy"), (1e6, 1e4, "cpu")):
        profile = synthetic(**{**CLIENT, "cpu_gflops": cpu_gflops, "cpu_mem_gbps": cpu_mem_gbps})
        on_cpu = Estimator(model, profile, zero_copy=False).simulate(placement, 1, 1024)
        read = Estimator(model, profile, zero_copy=True, zero_copy_cpu_share=0.0).simulate(placement, 1, 1024)
        assert read.cpu_busy == 0 < on_cpu.cpu_busy
        assert read.seconds >= routed / (CLIENT["h2d_gbps"] * 1e9) / ZERO_COPY_EFFICIENCY * 0.99
        assert (read.seconds < on_cpu.seconds) == (faster == "zero_copy")
    rows = Estimator(model, profile).zero_copy_rows + 1
    many = Estimator(model, profile, zero_copy=True).simulate(placement, rows, 1024)
    assert many.cpu_busy > 0
    assert Estimator(model, profile).zero_copy is False  # as the executor runs here (no GPU, or off)


def test_zero_copy_reads_go_at_the_share_of_the_copy_engine_the_profile_measured():
    """A profile with its ``zero_copy`` table prices the kernels' reads at its measured share of the
    copy engine's rate (the H100 machine read at 61-63%, the H200 machine at 92%); without one, at
    ZERO_COPY_EFFICIENCY; the balanced CPU share moves toward the CPU where the link reads slower."""
    from vramshard.plan.estimator import ZERO_COPY_EFFICIENCY, balanced_zero_copy_share, zero_copy_efficiency
    from vramshard.plan.memory import moe_layers, sublayer_triples
    from vramshard.plan.placement import named_placement
    from vramshard.profile import Profile

    model = shape_model("qwen3-30b-a3b")
    moe = [s for s in model if s.name.startswith("ffn")]
    placement = named_placement("experts-cpu", sublayer_triples(model), model.args.num_hidden_layers,
                                moe_layers=moe_layers(model))
    routed = sum(s.top_k * s.expert_bytes for s in moe)
    plain = synthetic(**{**CLIENT, "cpu_gflops": 3000})
    measured = Profile({**plain.to_dict(), "zero_copy": {"bytes": 75_497_472, "seconds": 0.0024,
                                                         "copy_seconds": 0.0015}})
    assert plain.zero_copy_efficiency is None and zero_copy_efficiency(plain) == ZERO_COPY_EFFICIENCY
    assert measured.zero_copy_efficiency == pytest.approx(0.625)
    fast = Estimator(model, plain, zero_copy=True).simulate(placement, 1, 1024)
    slow = Estimator(model, measured, zero_copy=True).simulate(placement, 1, 1024)
    assert fast.copy_busy >= routed / (CLIENT["h2d_gbps"] * 1e9) / ZERO_COPY_EFFICIENCY * 0.99
    assert slow.copy_busy == pytest.approx(fast.copy_busy * ZERO_COPY_EFFICIENCY / 0.625, rel=0.01)
    assert slow.seconds > fast.seconds
    assert balanced_zero_copy_share(model, measured) > balanced_zero_copy_share(model, plain)


def test_a_profile_with_a_malformed_zero_copy_table_is_refused():
    from vramshard.errors import ProfileError
    from vramshard.profile import Profile

    data = synthetic(**CLIENT).to_dict()
    for table in ({"bytes": 1, "seconds": 0.0, "copy_seconds": 1.0}, {"bytes": 1, "seconds": 1.0}, [1, 2]):
        with pytest.raises(ProfileError, match="zero.copy"):
            Profile({**data, "zero_copy": table})


def test_a_cpu_share_beside_the_zero_copy_kernels_moves_reads_from_the_link_to_the_cpu():
    """zero_copy_cpu_share: each token's first experts are the CPU's work (after the router), the
    rest the link's, read by kernels queued without waiting for the host; all on the CPU reads
    nothing over the link. (Which is faster is not asserted: the estimator put the balanced share
    ahead, and the H200 machine ran the first version of it, split by expert, slower.)"""
    from vramshard.plan.estimator import ZERO_COPY_EFFICIENCY, balanced_zero_copy_share
    from vramshard.plan.memory import moe_layers, sublayer_triples
    from vramshard.plan.placement import named_placement

    model = shape_model("qwen3-30b-a3b")
    moe = [s for s in model if s.name.startswith("ffn")]
    placement = named_placement("experts-cpu", sublayer_triples(model), model.args.num_hidden_layers,
                                moe_layers=moe_layers(model))
    routed = sum(s.top_k * s.expert_bytes for s in moe)
    profile = synthetic(**{**CLIENT, "cpu_gflops": 3000, "cpu_mem_gbps": CLIENT["h2d_gbps"]})
    share = balanced_zero_copy_share(model, profile)
    assert 0.2 < share < 0.8
    kernels = Estimator(model, profile, zero_copy=True).simulate(placement, 1, 1024)  # (no share by default)
    both = Estimator(model, profile, zero_copy=True, zero_copy_cpu_share=share).simulate(placement, 1, 1024)
    cpu = Estimator(model, profile, zero_copy=False).simulate(placement, 1, 1024)
    assert kernels.cpu_busy == 0
    assert both.seconds < cpu.seconds
    assert 0 < both.cpu_busy < cpu.cpu_busy
    assert both.copy_busy < routed / (CLIENT["h2d_gbps"] * 1e9) / ZERO_COPY_EFFICIENCY
    everything = Estimator(model, profile, zero_copy=True, zero_copy_cpu_share=1.0).simulate(placement, 1, 1024)
    assert everything.copy_busy == pytest.approx(0, abs=1e-6) and everything.cpu_busy > both.cpu_busy


def test_a_cpu_share_on_the_run_ahead_worker_overlaps_the_kernels_instead_of_following_the_host():
    """run_ahead with zero_copy_cpu_share: the CPU's share is the worker's, the host queuing on
    without waiting: the same CPU work and link reads as on the host thread; where the CPU's
    share is the longer side (half of the experts here) the step is shorter, since the next
    layer is queued by the time the share lands, and never shorter than the CPU's work (each
    layer's share needs the layer before it)."""
    from vramshard.plan.memory import moe_layers, sublayer_triples
    from vramshard.plan.placement import named_placement

    model = shape_model("qwen3-30b-a3b")
    placement = named_placement("experts-cpu", sublayer_triples(model), model.args.num_hidden_layers,
                                moe_layers=moe_layers(model))
    profile = synthetic(**{**CLIENT, "cpu_gflops": 3000, "cpu_mem_gbps": CLIENT["h2d_gbps"]})
    share = 0.5
    steps = {ahead: Estimator(model, profile, zero_copy=True, zero_copy_cpu_share=share,
                              run_ahead=ahead).simulate(placement, 1, 1024) for ahead in (False, True)}
    host, worker = steps[False], steps[True]
    assert worker.copy_busy == pytest.approx(host.copy_busy)
    assert worker.cpu_busy == pytest.approx(host.cpu_busy, rel=0.05)
    assert worker.cpu_busy <= worker.seconds < host.seconds


def test_prepacked_cpu_ffns_take_the_profiles_packed_factor_not_the_split_slices_one():
    """cpu_packed: a dense FFN on the CPU, whole or a split's CPU part, takes the profile's packed
    factor at its rows (packed once, a part reads no slices); other sub-layers and the GPU side
    are unchanged, and so is everything without packing."""
    import copy

    from vramshard.layers.mlp import DenseFFN
    from vramshard.profile.query import DECODE_ROWS, Profile
    from vramshard.runtime import cpu_packed as cpu_packed_mod

    base = synthetic(**CLIENT)
    data = copy.deepcopy(base.data)
    data["split_part"] = {"bf16": 1.5}
    data["packed_ffn"] = {"bf16": {"1": 0.5, "64": 0.8}}
    profile = Profile(data)
    model = shape_model("llama3-8b")
    ffn = next(s for s in model if isinstance(s, DenseFFN))
    attn = next(s for s in model if s.kind == "attn")
    # (one row by the C kernel takes no packed factor: the next test)
    plain = Estimator(model, profile, cpu_packed=False, cpu_gemv=False)
    packed = Estimator(model, profile, cpu_packed=True, cpu_gemv=False)
    for rows, factor in ((1, 0.5), (64, 0.8)):
        assert packed.compute_s(ffn, "cpu", rows, 1024) == pytest.approx(factor * plain.compute_s(ffn, "cpu", rows, 1024))
        assert packed.compute_s(ffn, "cuda", rows, 1024) == pytest.approx(plain.compute_s(ffn, "cuda", rows, 1024))
        assert packed.compute_s(attn, "cpu", rows, 1024) == pytest.approx(plain.compute_s(attn, "cpu", rows, 1024))
        half = ffn.num_pieces // 2
        launches = packed.part_s(ffn, "cpu", rows, 0, ffn.num_pieces) - packed.compute_s(ffn, "cpu", rows, 1024)
        part_packed = packed.part_s(ffn, "cpu", rows, 0, half) - launches
        part_plain = plain.part_s(ffn, "cpu", rows, 0, half) - launches
        assert part_packed == pytest.approx(part_plain / 1.5 * factor, rel=0.02)
    assert Estimator(model, profile).cpu_packed is cpu_packed_mod.packs()  # as the executor runs by default
    for rows in (DECODE_ROWS + 1, 1024):  # prompt chunks compute plain parts (runtime/cpu_packed.py)
        assert packed.compute_s(ffn, "cpu", rows, 1024) == pytest.approx(plain.compute_s(ffn, "cpu", rows, 1024))
        assert packed.part_s(ffn, "cpu", rows, 0, 8) == pytest.approx(plain.part_s(ffn, "cpu", rows, 0, 8))


def test_ffn_work_through_the_matrix_tiles_takes_the_profiles_tiles_factor_not_packing(monkeypatch):
    """VRAMSHARD_CPU_AMX: bf16 dense FFN work of more rows than the one-row kernel's and up to the tiles' (a whole
    FFN, a split part) is priced at the profile's tiles factor of torch's time, never packed; fewer rows, more rows,
    another dtype and the switch off keep their pricing."""
    import copy

    from vramshard.layers import cpu_gemv
    from vramshard.layers.mlp import DenseFFN
    from vramshard.plan.estimator import DISPATCH_LAUNCHES, PART_LAUNCHES
    from vramshard.profile.query import Profile

    data = copy.deepcopy(synthetic(**CLIENT).data)
    data["packed_ffn"] = {"bf16": {"1": 0.5, "64": 0.5}}
    data["tiles_ffn"] = {"bf16": {"16": 0.9, "64": 0.6}}
    profile = Profile(data)
    assert profile.tiles_ffn_factor("bf16", 32) == pytest.approx(0.75) and profile.tiles_ffn_factor("fp16", 64) == 1
    model = shape_model("llama3-8b")
    ffn = next(s for s in model if isinstance(s, DenseFFN))
    monkeypatch.setattr(cpu_gemv, "amx", lambda: False)
    plain = Estimator(model, profile, cpu_packed=False, cpu_gemv=True)
    packed = Estimator(model, profile, cpu_packed=True, cpu_gemv=True)
    monkeypatch.setattr(cpu_gemv, "amx", lambda: True)
    tiles = Estimator(model, profile, cpu_packed=True, cpu_gemv=True)
    assert tiles.amx and not plain.amx
    for rows, factor in ((16, 0.9), (64, 0.6)):
        assert packed.packs_at(rows) and not tiles.packs_at(rows)
        assert tiles.compute_s(ffn, "cpu", rows, 1024) == pytest.approx(factor * plain.compute_s(ffn, "cpu", rows, 1024))
        launches = plain.dispatch_s("cpu") * (PART_LAUNCHES + 3) / DISPATCH_LAUNCHES  # (a CPU part's, not scaled)
        assert tiles.part_s(ffn, "cpu", rows, 0, 6) - launches == pytest.approx(
            factor * (plain.part_s(ffn, "cpu", rows, 0, 6) - launches))
    for rows in (1, 65, 512):
        assert tiles.compute_s(ffn, "cpu", rows, 1024) == pytest.approx(packed.compute_s(ffn, "cpu", rows, 1024))
    fp16 = shape_model("nemo-8b")
    assert not Estimator(fp16, profile, cpu_packed=True, cpu_gemv=True).amx
    # A part through the tiles is one bound call: the worker takes it where VRAMSHARD_RUN_AHEAD=bound.
    assert tiles._bound_part(64) and not plain._bound_part(64) and not tiles._bound_part(65)
    # A planning process prices the tiles as the engine's process will run them, whatever its own switch says.
    import dataclasses

    from vramshard.plan.mechanisms import Mechanisms, fixed_mechanisms
    from vramshard.plan.tiers import Tiers
    from vramshard.runtime import budget as budgets
    from vramshard.runtime.plan_wire import model_recipe, read_request, request

    for here in (False, True):
        monkeypatch.setattr(cpu_gemv, "amx", lambda: here)
        settings = budgets.PlanSettings(profile, Tiers((1,)), 1024, 2, "llama3-8b")
        *_, there = read_request(request(model_recipe(model), settings, None, None, False, Mechanisms.here()))
        assert there.amx is here
        monkeypatch.setattr(cpu_gemv, "amx", lambda: not here)
        with fixed_mechanisms(dataclasses.replace(there, cpu_gemv=True)):
            assert Estimator(model, profile, cpu_packed=True).amx is here


def test_one_row_ffns_by_the_c_kernel_take_no_packed_factor(monkeypatch):
    """cpu_gemv: where the C kernel computes one-row dense FFNs and split parts from the plain weights
    (layers/cpu_gemv.py), a one-row step is priced as plain even with packing on; more rows stay packed."""
    import copy

    from vramshard.layers.mlp import DenseFFN
    from vramshard.profile.query import Profile
    from vramshard.plan.mechanisms import cpu_gemv_enabled
    from vramshard.layers import cpu_gemv

    monkeypatch.setenv("VRAMSHARD_CPU_AMX", "off")  # (as beside a GPU: 64 rows through the tiles pack none)
    data = copy.deepcopy(synthetic(**CLIENT).data)
    data["split_part"] = {"bf16": 1.5}
    data["packed_ffn"] = {"bf16": {"1": 0.5, "64": 0.8}}
    profile = Profile(data)
    model = shape_model("llama3-8b")
    ffn = next(s for s in model if isinstance(s, DenseFFN))
    plain = Estimator(model, profile, cpu_packed=False, cpu_gemv=True)
    both = Estimator(model, profile, cpu_packed=True, cpu_gemv=True)
    packed = Estimator(model, profile, cpu_packed=True, cpu_gemv=False)
    half = ffn.num_pieces // 2
    assert both.compute_s(ffn, "cpu", 1, 1024) == pytest.approx(plain.compute_s(ffn, "cpu", 1, 1024))
    assert both.part_s(ffn, "cpu", 1, 0, half) == pytest.approx(plain.part_s(ffn, "cpu", 1, 0, half))
    assert packed.compute_s(ffn, "cpu", 1, 1024) == pytest.approx(0.5 * plain.compute_s(ffn, "cpu", 1, 1024))
    assert both.compute_s(ffn, "cpu", 64, 1024) == pytest.approx(packed.compute_s(ffn, "cpu", 64, 1024))
    assert cpu_gemv_enabled() is cpu_gemv.computes(1) and Estimator(model, profile).cpu_gemv is cpu_gemv.computes(1)


def test_zero_copy_reads_a_cached_layers_misses_over_the_link_and_its_hits_from_vram():
    """``experts-stream`` with zero-copy kernels at decode: the link carries only the misses (the
    hit rate's complement of the routed bytes), no expert runs on the CPU, and a cache that holds
    every routed expert leaves the link idle."""
    from vramshard.plan.estimator import ZERO_COPY_EFFICIENCY
    from vramshard.plan.memory import moe_layers, sublayer_triples
    from vramshard.plan.placement import named_placement

    model = shape_model("qwen3-30b-a3b")
    moe = [s for s in model if s.name.startswith("ffn")]
    placement = named_placement("experts-stream", sublayer_triples(model), model.args.num_hidden_layers,
                                moe_layers=moe_layers(model))
    profile = synthetic(**CLIENT)
    routed = sum(s.top_k * s.expert_bytes for s in moe)
    link = {}
    for hit_rate in (0.0, 0.5, 1.0):
        step = Estimator(model, profile, expert_hit_rate=hit_rate, zero_copy=True).simulate(placement, 1, 1024)
        assert step.cpu_busy < 1e-4  # (the embedding's row lookup on the CPU)
        link[hit_rate] = step.copy_busy
    assert link[0.0] >= routed / (CLIENT["h2d_gbps"] * 1e9) / ZERO_COPY_EFFICIENCY * 0.99
    assert link[0.5] == pytest.approx(link[0.0] / 2, rel=0.05) and link[1.0] < 1e-3
    copied = Estimator(model, profile, expert_hit_rate=0.5, zero_copy=False).simulate(placement, 1, 1024)
    assert link[0.5] == pytest.approx(copied.copy_busy / ZERO_COPY_EFFICIENCY, rel=0.02)  # the same bytes, read


def test_an_estimator_that_simulated_other_steps_predicts_each_as_a_fresh_one_does():
    """The estimator keeps each step size's per-sub-layer costs across simulations (a plan simulates
    thousands of steps): whatever it simulated before, a step's prediction is a fresh estimator's."""
    profile = synthetic(**CLIENT, cpu_contention=2.0)
    placements = [cpu_placement(GPU_RESIDENT), cpu_placement(GPU_STREAMED), split_placement(3), split_placement(9)]
    steps = [(1, 1024), (16, 1024), (1, 4096), (512, 4096)]
    used = Estimator(NEMO, profile)
    for placement in placements:  # every step size with and without streams, split parts at two cuts
        for tokens, context in steps:
            used.simulate(placement, tokens, context)
    for placement in reversed(placements):
        for tokens, context in reversed(steps):
            fresh = Estimator(NEMO, profile).simulate(placement, tokens, context)
            again = used.simulate(placement, tokens, context)
            assert (again.seconds, again.cpu_busy, again.gpu_busy, again.copy_busy) == \
                (fresh.seconds, fresh.cpu_busy, fresh.gpu_busy, fresh.copy_busy), (placement.name, tokens, context)
