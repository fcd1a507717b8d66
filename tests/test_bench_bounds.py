"""The bytes a decode step reads: the denominator of the benches' memory-bandwidth bounds."""

import json

import pytest
import torch

from benchmarks.common import decode_read_bytes
from vramshard.runtime.wire_codec import RATIO
from vramshard.models import build_model
from vramshard.shapes import shape_config, shape_model


def test_decode_reads_every_weight_but_an_untied_embedding_table_plus_the_kv_cache():
    model = shape_model("nemo-8b")
    config = shape_config("nemo-8b")
    table = config["vocab_size"] * config["hidden_size"] * 2  # fp16
    assert decode_read_bytes(model) == model.nbytes - table
    assert decode_read_bytes(model, 1024) == model.nbytes - table + 1024 * model.kv_bytes_per_token()


def test_a_head_tied_to_the_embedding_still_reads_the_table():
    config = dict(shape_config("nemo-8b"), tie_word_embeddings=True)
    model = build_model(config, torch.float16)
    assert decode_read_bytes(model) == model.nbytes


def test_cpu_read_method_times_every_method_and_its_steps(tmp_path):
    from benchmarks import cpu_read_method

    out = tmp_path / "read.json"
    result = cpu_read_method.main(["--gib", "0.004", "--shape", "256,512", "--dtypes", "fp32", "--rounds", "2",
                                   "--calls", "4", "--json", str(out)])
    row = result["dtypes"]["fp32"]
    assert set(row["gb_s"]) == set(cpu_read_method.METHODS) and all(v > 0 for v in row["gb_s"].values())
    assert row["weights"] == int(0.004 * 2**30 // (256 * 512 * 4)) and 1 <= row["ring_weights"] <= row["weights"]
    steps = row["ring_size_effect"] * row["statistic_effect"] * row["fresh_clones_effect"]
    assert abs(steps - row["profile_over_walk"]) < 1e-9 * row["profile_over_walk"]  # the steps multiply out
    assert json.loads(out.read_text())["shape"] == [256, 512]
    with pytest.raises(SystemExit, match="unknown dtype"):
        cpu_read_method.main(["--dtypes", "int4", "--gib", "0.001", "--shape", "8,8"])


def test_engine_bench_bounds_decode_by_the_smaller_of_the_two_readers_alone_and_host_memory_shared():
    """engine_bench's decode bound at a budget: the bytes outside VRAM at PCIe + CPU read, each
    alone, or at what host memory gives both at once, whichever is smaller (kept apart too)."""
    from benchmarks.engine_bench import derived

    GiB = 2**30
    cells = [{"engine": "unconstrained", "vram": None, "tg_tok_s": 100.0, "ttft_s": 0.03, "resident_bytes": 16e9},
             {"engine": "vramshard", "vram": 8 * GiB, "tg_tok_s": 10.0, "ttft_s": 0.2, "resident_bytes": 6e9,
              "batched": {}}]
    alone = {"h2d": 50.0, "cpu_read": 100.0, "device": 4000.0}
    checks = derived(cells, 16e9, 15e9, alone)
    assert checks["8GiB_decode_bound_tok_s"] == pytest.approx(15.0)  # 150 GB/s over 10 GB
    assert checks["8GiB_decode_fraction_of_bound"] == pytest.approx(10 / 15)
    shared = derived(cells, 16e9, 15e9, dict(alone, shared_total=120.0))
    assert shared["8GiB_decode_bound_tok_s"] == pytest.approx(12.0)
    assert shared["8GiB_decode_additive_bound_tok_s"] == pytest.approx(15.0)
    assert shared["8GiB_decode_fraction_of_bound"] == pytest.approx(10 / 12)
    roomy = derived(cells, 16e9, 15e9, dict(alone, shared_total=200.0))
    assert roomy["8GiB_decode_bound_tok_s"] == pytest.approx(15.0)


def test_engine_bench_bounds_coded_fills_by_the_raw_bytes_the_link_carries():
    """With stream fills coded at ratio r, PCIe carries 1/r raw bytes a byte, alone and in the shared cap;
    the CPU's read is unchanged; raw fills (r = 1) keep the measured rates."""
    from benchmarks.common import coded_link, decode_bound_tok_s

    measured = {"h2d": 50.0, "cpu_read": 100.0, "device": 4000.0, "shared_cpu": 80.0, "shared_h2d": 40.0,
                "shared_total": 120.0}
    assert coded_link(measured, 1.0) is measured
    coded = coded_link(measured, 0.8)
    assert coded["h2d"] == pytest.approx(62.5) and coded["cpu_read"] == 100.0
    assert coded["shared_h2d"] == pytest.approx(50.0) and coded["shared_total"] == pytest.approx(130.0)
    assert measured["h2d"] == 50.0  # (the measured rates kept as they were)
    bound, additive = decode_bound_tok_s(10e9, coded)
    assert additive == pytest.approx(16.25) and bound == pytest.approx(13.0)


def test_engine_bench_judges_a_planned_cell_against_its_baseline_by_the_hosts_read_around_each():
    """Each cell carries the host's read before and after it: the checks give the planned cell's read over
    its baseline's (a lead partly the host's where it is off 1) and decode's bound at the planned cell's
    read, the shared cap scaled alike; cells without reads get neither."""
    from benchmarks.engine_bench import derived

    GiB = 2**30
    ours = {"engine": "vramshard", "vram": 2 * GiB, "tg_tok_s": 6.0, "ttft_s": 0.3, "resident_bytes": 1e9,
            "batched": {}, "host_read_gb_s": [60.0, 40.0]}
    base = {"engine": "layers:max", "vram": 2 * GiB, "tg_tok_s": 5.0, "ttft_s": 2.0, "resident_bytes": 1e9,
            "batched": {}, "host_read_gb_s": [100.0, 100.0]}
    bandwidth = {"h2d": 50.0, "cpu_read": 100.0, "device": 4000.0, "shared_total": 120.0}
    checks = derived([ours, base], 16e9, 15e9, bandwidth)
    assert checks["2GiB_host_read_vramshard_over_layers_max"] == pytest.approx(0.5)
    assert checks["2GiB_decode_bound_tok_s"] == pytest.approx(8.0)  # the shared 120 GB/s over 15 GB
    # At half the read: 50 + 50 GB/s alone, 60 shared: 60 GB/s over 15 GB.
    assert checks["2GiB_decode_bound_at_cell_read_tok_s"] == pytest.approx(4.0)
    assert checks["2GiB_decode_fraction_of_bound_at_cell_read"] == pytest.approx(1.5)
    bare = derived([dict(ours, host_read_gb_s=None), dict(base, host_read_gb_s=None)], 16e9, 15e9, bandwidth)
    assert not any("host_read" in k or "at_cell_read" in k for k in bare)


def test_engine_bench_abba_rounds_give_each_check_as_the_geometric_mean_of_the_rounds():
    """--abba cells carry their round; the unconstrained engine's (no round) counts in both. Each check is
    the geometric mean of the rounds' that have it, and each round's checks are kept."""
    from benchmarks.engine_bench import derived, derived_rounds

    GiB = 2**30
    free = {"engine": "unconstrained", "vram": None, "tg_tok_s": 100.0, "ttft_s": 0.03, "resident_bytes": 16e9}

    def cell(engine, tg, round_):
        return {"engine": engine, "vram": 2 * GiB, "tg_tok_s": tg, "ttft_s": 0.3, "resident_bytes": 1e9,
                "batched": {}, "round": round_}

    cells = [free, cell("vramshard", 9.0, 1), cell("layers:max", 6.0, 1), cell("layers:max", 10.0, 2),
             cell("vramshard", 8.0, 2)]
    bandwidth = {"h2d": 50.0, "cpu_read": 100.0, "device": 4000.0}
    checks = derived_rounds(cells, 16e9, 15e9, bandwidth)
    assert [r["2GiB_tg_speedup_vs_layers_max"] for r in checks["rounds"]] == pytest.approx([1.5, 0.8])
    assert checks["2GiB_tg_speedup_vs_layers_max"] == pytest.approx((1.5 * 0.8) ** 0.5)
    assert checks["2GiB_decode_fraction_of_bound"] == pytest.approx((9.0 * 8.0) ** 0.5 / 10.0)  # bound 10 tok/s
    assert checks["unconstrained_decode_fraction_of_bandwidth_bound"] == pytest.approx(
        derived([free], 16e9, 15e9, bandwidth)["unconstrained_decode_fraction_of_bandwidth_bound"])
    # A round that lost its baseline (an error) leaves its speedup to the other round.
    lost = derived_rounds(cells[:3] + [cells[4]], 16e9, 15e9, bandwidth)
    assert lost["2GiB_tg_speedup_vs_layers_max"] == pytest.approx(1.5)
    plain = [{k: v for k, v in c.items() if k != "round"} for c in cells[:3]]
    assert derived_rounds(plain, 16e9, 15e9, bandwidth) == derived(plain, 16e9, 15e9, bandwidth)


def test_plan_replay_predicts_the_baselines_of_an_engine_bench_run(tmp_path, capsys):
    """plan_replay baselines: each layers:N cell's decode step as the estimator predicts it from the
    profile (scaled as the run's profile source says), against the step the cell measured."""
    import types
    from pathlib import Path

    from benchmarks.plan_replay import baselines

    GiB = 2**30
    result = {"profile": "docs/profiles/h200-run33.json (CPU times x1.50: the host's memory read now)",
              "args": {"pp": 1024, "tg": 32},
              "models": {"llama3-8b": {"cells": [
                  {"engine": "layers:max", "placement": "layers:17", "vram": 8 * GiB, "decode_step_ms_median": 100.0,
                   "batched": {"64": {"decode_step_ms_median": 150.0, "decode_host_compute_ms_median": 140.0}}},
                  {"engine": "vramshard", "placement": "planned(...)", "vram": 8 * GiB, "decode_step_ms_median": 90.0}]}}}
    path = tmp_path / "engine.json"
    path.write_text(json.dumps(result))
    profile = str(Path(__file__).resolve().parent.parent / "docs" / "profiles" / "h200-run33.json")
    baselines(types.SimpleNamespace(result=str(path), profile=profile))
    scaled = capsys.readouterr().out.strip().splitlines()
    result["profile"] = "docs/profiles/h200-run33.json"
    path.write_text(json.dumps(result))
    baselines(types.SimpleNamespace(result=str(path), profile=profile))
    plain = capsys.readouterr().out.strip().splitlines()
    assert len(scaled) == len(plain) == 2 and plain[0].startswith("llama3-8b layers:17 at 8 GiB: predicted ")
    ms = [float(line.split("predicted ")[1].split(" ms")[0]) for line in (scaled[0], plain[0])]
    assert 50 < ms[1] < 200 and ms[0] > 1.2 * ms[1]  # the CPU's 15 layers priced 1.5x slower
    # ... and its batch of 64: the step and the CPU work in it, against the measured ones
    assert plain[1].strip().startswith("batch 64: predicted step ")
    assert "measured 150.0 ms (CPU work 140.0: " in plain[1]
    cpu = [float(line.split("(CPU work ")[1].split(")")[0]) for line in (scaled[1], plain[1])]
    assert cpu[0] == pytest.approx(1.5 * cpu[1], rel=0.02) and cpu[1] > 0


def test_engine_bench_bounds_a_batched_step_by_pcie_and_the_cpus_matmuls_at_that_many_rows():
    """engine_bench's batched bound: a step of B sequences' next tokens with every byte outside VRAM over
    PCIe or through the CPU's matmuls at B rows (the profile's weight rate), both no faster than host memory
    shared gives them, against the baseline's measured batch; the CPU's rate comes from the profile for the
    model's FFN shape."""
    from benchmarks.engine_bench import cpu_rows_gb_s, derived
    from vramshard.profile import synthetic

    GiB = 2**30
    cells = [{"engine": "vramshard", "vram": 8 * GiB, "tg_tok_s": 10.0, "ttft_s": 0.2, "resident_bytes": 6e9,
              "batched": {"1": {"tok_s": 10.0}, "64": {"tok_s": 400.0}}},
             {"engine": "layers:max", "vram": 8 * GiB, "tg_tok_s": 9.0, "ttft_s": 1.0, "resident_bytes": 6e9,
              "batched": {"1": {"tok_s": 9.0}, "64": {"tok_s": 200.0}}}]
    checks = derived(cells, 16e9, 15e9, {"h2d": 50.0, "cpu_read": 100.0, "device": 4000.0}, {64: 30.0, 1: 90.0})
    assert checks["8GiB_batch64_step_bound_tok_s"] == pytest.approx(64 * 80 / 10)  # 80 GB/s over 10 GB
    assert checks["8GiB_batch64_step_bound_over_layers_max"] == pytest.approx(512 / 200)
    assert "8GiB_batch64_run_bound_over_layers_max" not in checks  # (no prompt step measured)
    cells[0]["batched"]["64"].update(prefill_s=0.5, generated=1024, decode_tok_s=600.0)
    cells[1]["batched"]["64"]["decode_tok_s"] = 300.0
    checks = derived(cells, 16e9, 15e9, {"h2d": 50.0, "cpu_read": 100.0, "device": 4000.0}, {64: 30.0, 1: 90.0})
    # 1024 tokens: the prompt step's 0.5 s, then 15 decode steps of 64 tokens at 512 tok/s (0.125 s each)
    assert checks["8GiB_batch64_run_bound_over_layers_max"] == pytest.approx(1024 / (0.5 + 15 * 0.125) / 200)
    assert checks["8GiB_batch64_decode_speedup_vs_layers_max"] == pytest.approx(2.0)
    assert "8GiB_batch64_step_bound_tok_s" not in derived(cells, 16e9, 15e9, {"h2d": 50.0, "cpu_read": 100.0,
                                                                             "device": 4000.0})
    # Host memory shared by both readers caps the sum: 60 GB/s together over the 10 GB outside VRAM.
    shared = derived(cells, 16e9, 15e9, {"h2d": 50.0, "cpu_read": 100.0, "device": 4000.0, "shared_total": 60.0},
                     {64: 30.0, 1: 90.0})
    assert shared["8GiB_batch64_step_bound_tok_s"] == pytest.approx(64 * 60 / 10)
    assert shared["8GiB_batch64_step_additive_bound_tok_s"] == pytest.approx(64 * 80 / 10)
    model = shape_model("llama3-8b")
    profile = synthetic(cpu_gflops=1000.0, gpu_gflops=100000.0, h2d_gbps=50.0, cpu_mem_gbps=100.0)
    one, many = cpu_rows_gb_s(profile, model, 1), cpu_rows_gb_s(profile, model, 256)
    assert 0 < many < one <= 100.0  # compute-bound at many rows, no faster than memory at one
    assert cpu_rows_gb_s(None, model, 64) is None


def test_moe_bench_bounds_experts_on_the_cpu_by_the_hosts_read_alone_and_any_cell_by_both_readers():
    """qwen3-30b-a3b with every sub-layer but the MoE layers in VRAM (experts-cpu's layout): its decode step needs
    each MoE layer's top-k experts from host memory; the bound over PCIe and the host's read (capped by what host
    memory gives both), over PCIe alone, and over the host's read alone (the CPU's path: experts-cpu's ceiling)."""
    from types import SimpleNamespace

    from benchmarks.moe_bench import routed_bound
    from vramshard.layers.moe import MoEFFN

    model = shape_model("qwen3-30b-a3b")
    moe = [s for s in model if isinstance(s, MoEFFN)]
    executor = SimpleNamespace(resident={s.name for s in model if not isinstance(s, MoEFFN)}, expert_cache=None,
                               split_weights={s.name: {} for s in moe}, wire_codec=False)
    bw = {"h2d": 55.0e9, "cpu_read": 125.0e9, "shared_total": 145.0e9}
    bound = routed_bound(model, executor, bw)
    routed = bound["routed_bytes_per_token"]
    assert len(moe) == 48 and 3.5e9 < routed < 3.8e9  # 48 layers x 8 experts x 3 x 2048 x 768 bf16
    assert bound["missed_routed_bytes"] == routed and bound["other_nonresident_bytes"] == 0
    assert bound["bound_tok_s"] == pytest.approx(145.0e9 / routed)  # (the shared cap, below 55 + 125)
    assert bound["host_read_bound_tok_s"] == pytest.approx(125.0e9 / routed)
    assert bound["pcie_bound_tok_s"] == pytest.approx(55.0e9 / routed)
    # A streamed attention's bytes count at the codec's ratio where its fills are coded (the experts' stay raw).
    attention = next(s for s in model if s.kind == "attn")
    executor.resident.discard(attention.name)
    raw = routed_bound(model, executor, bw)
    executor.wire_codec = True
    coded = routed_bound(model, executor, bw)
    assert raw["other_nonresident_bytes"] == coded["other_nonresident_bytes"] == attention.nbytes
    assert coded["pcie_bound_tok_s"] == pytest.approx(55.0e9 / (routed + RATIO * attention.nbytes))
    assert raw["pcie_bound_tok_s"] == pytest.approx(55.0e9 / (routed + attention.nbytes))


def test_plan_replay_batch_packs_at_64_rows_only_where_the_packed_factor_gains(capsys):
    """plan_replay batch: with packing on, the profile's packed factor (0.60 at 64 rows in h100-run40) makes a
    different tier-64 plan than packing off; the same factor timed at 1.2x plain makes the same plan (no packing)."""
    import types
    from pathlib import Path

    from benchmarks.plan_replay import batch

    profile = str(Path(__file__).resolve().parent.parent / "docs" / "profiles" / "h100-run40.json")
    lines = {}
    for packed in ("", "8:1.2,16:1.2,64:1.2"):
        batch(types.SimpleNamespace(profile=profile, cpu_scale=1.76, compute_rows="8:1.2,16:1.4,64:2.0,512:2.0",
                                    packed=packed))
        off, on = capsys.readouterr().out.strip().splitlines()
        assert off.startswith("packing off") and on.startswith("packing on")
        lines[packed] = (off.split(": ", 1)[1], on.split(": ", 1)[1])
    assert lines[""][0] != lines[""][1]
    assert lines["8:1.2,16:1.2,64:1.2"][0] == lines["8:1.2,16:1.2,64:1.2"][1] == lines[""][0]


def test_plan_replay_step_prices_one_placement_with_its_cpu_and_copies_slowed(capsys):
    """plan_replay step: the plan's own step, then the same placement with its CPU work x the factor (its CPU time
    grows by that factor) and its copies beside CPU work at the rate given (their time is the streamed bytes at that
    rate, or more), and both: each at least as slow as the plan's own."""
    import re
    import types
    from pathlib import Path

    from benchmarks.plan_replay import step

    profile = str(Path(__file__).resolve().parent.parent / "docs" / "profiles" / "h100-run40.json")
    step(types.SimpleNamespace(profile=profile, cpu_scale=1.19, compute_rows="16:1.26,64:0.96,512:0.89",
                               cpu_factor=1.5, copies_gbps=30.0, budget=8.0))
    rows = [tuple(float(x) for x in re.search(r": ([\d.]+) ms \(CPU ([\d.]+), copies ([\d.]+)", line).groups())
            for line in capsys.readouterr().out.strip().splitlines()]
    (step_ms, cpu, copies), slower_cpu, slower_copies, both = rows
    assert slower_cpu[1] == pytest.approx(1.5 * cpu, rel=0.05) and slower_cpu[2] == pytest.approx(copies, rel=0.01)
    assert slower_copies[1] == pytest.approx(cpu, rel=0.01) and slower_copies[2] > 1.5 * copies  # (55 -> 30 GB/s)
    assert min(slower_cpu[0], slower_copies[0]) > step_ms and both[0] >= max(slower_cpu[0], slower_copies[0]) - 0.1
