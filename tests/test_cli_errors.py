"""The CLI turns bad input into a one-line message and an exit code, never a traceback."""

import json
import shutil
import subprocess
import sys

import pytest


def vramshard(*args):
    return subprocess.run([sys.executable, "-m", "vramshard.cli.main", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("case", ["no_config", "unknown_arch", "truncated", "missing_path"])
def test_bad_model_exit_code(case, tiny_model_dir, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir("llama"), model)
    if case == "no_config":
        (model / "config.json").unlink()
    elif case == "unknown_arch":
        cfg = json.loads((model / "config.json").read_text())
        cfg["architectures"] = ["FalconForCausalLM"]
        (model / "config.json").write_text(json.dumps(cfg))
    elif case == "truncated":
        data = (model / "model.safetensors").read_bytes()
        (model / "model.safetensors").write_bytes(data[:-100])
    else:
        model = tmp_path / "absent"
    result = vramshard("run", model, "--ids", "1,2,3", "-n", "2", "--device", "cpu")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "error:" in result.stderr


def test_bad_token_and_long_prompt_exit_code(tiny_model_dir):
    model = tiny_model_dir("llama")
    result = vramshard("run", model, "--ids", "1,2,999", "-n", "2", "--device", "cpu")
    assert result.returncode == 3 and "out of range" in result.stderr and "Traceback" not in result.stderr
    ids = ",".join(["1"] * 300)  # the tiny model has 256 positions
    result = vramshard("run", model, "--ids", ids, "-n", "2", "--device", "cpu")
    assert result.returncode == 3 and "context" in result.stderr and "Traceback" not in result.stderr
