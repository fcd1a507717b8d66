"""benchmarks/engine_step_profile.py runs end to end (CPU smoke test on a tiny shape; the GPU run
is the benchmark)."""

import json
import sys

from benchmarks import engine_step_profile


def test_the_engine_step_profile_runs_on_the_cpu(tmp_path, monkeypatch):
    out = tmp_path / "steps.json"
    monkeypatch.setattr(sys, "argv", ["engine_step_profile", "--shape", "tiny-llama", "--device", "cpu",
                                      "--seqs", "20", "--steps", "3", "--json", str(out)])
    engine_step_profile.main()
    result = json.loads(out.read_text())
    assert result["steps"] == 3 and result["rows"] == 20
    assert 0 < result["forward_ms"] <= result["step_ms"]
    assert any(entry["name"] == "aten::mm" for entry in result["top_host"])
