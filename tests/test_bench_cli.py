"""`vramshard bench` on the CPU: a random-weight shape and a checkpoint, table, JSON and PNG."""

import json

import pytest

from vramshard.cli.bench import BenchSettings
from vramshard.cli.main import main
from vramshard.errors import InvalidInputError
from vramshard.shapes import SHAPES, shape_model

SMALL = ["--pp", "24", "--tg", "6", "--batch-sizes", "1,4", "--batch-prompt", "5", "--batch-gen", "3"]


def test_bench_shape_end_to_end(tmp_path, capsys):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "chart" / "bench.png"
    code = main(["bench", "--shape", "tiny-llama", *SMALL, "--baselines", "cpu,layers:max", "--json", str(out_json),
                 "--png", str(out_png), "--device", "cpu"])
    assert code == 0
    table = capsys.readouterr().out
    assert "pp24" in table and "tg6" in table and "b4" in table and "vramshard" in table
    report = json.loads(out_json.read_text())
    assert report["model"] == "tiny-llama" and report["device"] == "cpu" and report["settings"]["pp"] == 24
    ours, cpu, gpu_only = report["results"]
    assert [ours["engine"], cpu["engine"], gpu_only["engine"]] == ["vramshard", "cpu", "layers:max"]
    assert "GPU" in gpu_only["error"]  # a GPU baseline on a CPU-only run is reported, not fatal
    for row in (ours, cpu):
        assert row["placement"] == "cpu" and row["complete"]
        assert row["pp_tok_s"] > 0 and row["tg_tok_s"] > 0 and 0 < row["ttft_s"] < row["e2e_s"]
        assert len(row["ttft_runs_s"]) == 1 and row["ttft_runs_s"][0] == row["ttft_s"]  # (one run: its own)
        # tg is the steady rate (median decode step); with every step counted it is a separate figure
        assert row["tg_tok_s"] == pytest.approx(1e3 / row["decode_step_ms_median"])
        assert row["tg_with_warmup_tok_s"] > 0
        assert set(row["batched"]) == {"1", "4"}
        batch = row["batched"]["4"]
        assert batch["generated"] == 12 and batch["tok_s"] > 0 and batch["complete"]
        assert 0 < row["sched_ms_per_step"] < 1e3 * row["e2e_s"]
        # A decode step: its preparation and its forward pass are parts of it.
        assert 0 < row["decode_prepare_ms"] < row["decode_sched_ms"]
        assert 0 < row["decode_forward_ms_median"] < row["decode_step_ms_median"]
        # (The single run's host time in split FFN parts is given beside its host computing, as each batch's is.)
        assert 0 <= row["decode_host_split_ms_median"] <= row["decode_host_compute_ms_median"]
        # Stalls: the slowest decode step is no faster than the median, the count of slow ones fits the steps.
        assert row["decode_step_ms_max"] >= row["decode_step_ms_median"] and row["prompt_step_ms_max"] > 0
        assert 0 <= row["decode_steps_over_2x_median"] < 6
        assert row["calibrations"] == [] and row["placement_at_end"] == "cpu"  # no GPU: nothing to fit
        assert row["vram_plan"]["total"] == row["vram_plan_bytes"] == 0  # (what the plan holds in VRAM, by part)
        assert {"plan", "host layout", "CPU kernels"} <= set(row["load_seconds"])  # where its load went
        assert row["load_s"] == pytest.approx(sum(row["load_seconds"].values()))
        assert row["kv_layers_in_vram"] == row["kv_layers_in_vram_at_end"] == 0  # (attention layers' KV in VRAM)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_checkpoint_and_moe_shape(tiny_model_dir, tmp_path, capsys):
    out_json = tmp_path / "ckpt.json"
    assert main(["bench", str(tiny_model_dir("llama")), *SMALL, "--batch-sizes", "2", "--json", str(out_json)]) == 0
    rows = json.loads(out_json.read_text())["results"]
    assert len(rows) == 1 and rows[0]["batched"]["2"]["generated"] == 6  # no baselines by default on a CPU
    assert main(["bench", "--shape", "tiny-qwen3-moe", *SMALL, "--batch-sizes", "2", "--repeat", "2"]) == 0
    assert "tiny-qwen3-moe" in capsys.readouterr().out


def test_bench_refuses_bad_arguments(tiny_model_dir, capsys):
    assert main(["bench", "--shape", "no-such-shape", "--device", "cpu"]) != 0
    assert "known shapes" in capsys.readouterr().err
    assert main(["bench", str(tiny_model_dir("llama")), "--shape", "tiny-llama", "--device", "cpu"]) != 0
    assert "not both" in capsys.readouterr().err
    assert main(["bench", "--device", "cpu"]) != 0
    with pytest.raises(InvalidInputError, match=">= 1"):
        BenchSettings(pp=0)


def test_tiny_shapes_are_small_and_build():
    for name in ("tiny-llama", "tiny-qwen3-moe"):
        assert name in SHAPES and shape_model(name).nbytes < 2**20
    settings = BenchSettings(pp=100, tg=28, batch_sizes=(1, 8), batch_prompt=10, batch_gen=6)
    assert settings.max_context == 128 and settings.kv_tokens == 128  # 8 x 16-token blocks vs one 128 sequence


def test_runs_keep_their_slowest_step_and_all_their_slow_steps():
    from vramshard.cli.bench import _median_runs, _over_twice_median

    assert _over_twice_median([0.1, 0.1, 0.1, 0.5, 0.25]) == 2 and _over_twice_median([]) is None
    runs = [{"ttft_s": 1.0, "decode_step_ms_max": 90.0, "decode_steps_over_2x_median": 1, "prompt_step_ms_max": 5.0},
            {"ttft_s": 3.0, "decode_step_ms_max": 3100.0, "decode_steps_over_2x_median": 2, "prompt_step_ms_max": 9.0},
            {"ttft_s": 2.0, "decode_step_ms_max": 80.0, "decode_steps_over_2x_median": 0, "prompt_step_ms_max": None}]
    merged = _median_runs(runs)
    assert merged["ttft_s"] == 2.0 and merged["decode_step_ms_max"] == 3100.0
    assert merged["decode_steps_over_2x_median"] == 3 and merged["prompt_step_ms_max"] == 9.0
