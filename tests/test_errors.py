"""Bad input gets a clear VramshardError naming the problem, never a deep traceback."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from vramshard import Engine
from vramshard.errors import HostMemoryError, InvalidInputError, ModelLoadError, UnsupportedArchitectureError
from vramshard.units import parse_size


@pytest.fixture
def model_copy(tiny_model_dir, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), dst)
    return dst


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        Engine.load(tmp_path / "nope")


def test_missing_config(model_copy):
    (model_copy / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="no config.json"):
        Engine.load(model_copy)


def test_unknown_architecture_is_named_and_supported_listed(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError) as info:
        Engine.load(model_copy)
    assert "GPTNeoXForCausalLM" in str(info.value) and "LlamaForCausalLM" in str(info.value)


def test_truncated_safetensors(model_copy):
    weights = model_copy / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="truncated"):
        Engine.load(model_copy)


def test_garbage_safetensors(model_copy):
    (model_copy / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ModelLoadError, match="not a valid safetensors"):
        Engine.load(model_copy)


def test_pickle_only_directory_is_refused(model_copy):
    (model_copy / "model.safetensors").unlink()
    (model_copy / "pytorch_model.bin").write_bytes(b"not even read")
    with pytest.raises(ModelLoadError, match="pickle"):
        Engine.load(model_copy)


def test_wrong_tensor_shape(model_copy):
    weights = load_file(model_copy / "model.safetensors")
    weights["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(weights, model_copy / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model.layers.1.mlp.up_proj.weight.*\[3, 3\]"):
        Engine.load(model_copy)


def test_missing_tensor(model_copy):
    weights = load_file(model_copy / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, model_copy / "model.safetensors")
    with pytest.raises(ModelLoadError, match="missing tensors model.norm.weight"):
        Engine.load(model_copy)


def test_token_id_out_of_range(tiny_model_dir):
    engine = Engine.load(tiny_model_dir("llama"), device="cpu")
    with pytest.raises(InvalidInputError, match="token id 96 is out of range"):
        engine.logits([1, 96])
    with pytest.raises(InvalidInputError, match="out of range"):
        engine.generate([[1, -1]], max_new_tokens=2)


def test_prompt_longer_than_context(tiny_model_dir):
    engine = Engine.load(tiny_model_dir("llama"), device="cpu", max_context=16)
    with pytest.raises(InvalidInputError, match="more than the context of 16"):
        engine.logits(list(range(17)))
    with pytest.raises(InvalidInputError, match="more than the context"):
        engine.generate([list(range(10))], max_new_tokens=10)


def test_bad_sizes_and_options(tiny_model_dir):
    with pytest.raises(InvalidInputError, match="cannot read size"):
        parse_size("4 potatoes")
    assert parse_size("2GiB") == 2 * 2**30 and parse_size("2048MiB") == 2 * 2**30
    with pytest.raises(InvalidInputError, match="device"):
        Engine.load(tiny_model_dir("llama"), device="tpu")
    with pytest.raises(InvalidInputError, match="dtype"):
        Engine.load(tiny_model_dir("llama"), dtype="int3")


def test_too_little_host_memory_is_said_before_loading(tiny_model_dir, monkeypatch):
    """The weights' host copy is pinned: a model larger than the memory available is refused with
    both sizes, before anything is read."""
    from vramshard import host_memory
    from vramshard.models import build_model
    from vramshard.loading.checkpoint import open_checkpoint

    model = build_model(open_checkpoint(tiny_model_dir("llama")).config)
    need = model.nbytes + max(s.nbytes for s in model)
    monkeypatch.setattr(host_memory, "meminfo_bytes", lambda field: need - 1 if field == "MemAvailable" else None)
    from vramshard.units import format_bytes

    with pytest.raises(HostMemoryError, match=rf"weights need {format_bytes(need)} of host memory; "
                                              rf"{format_bytes(need - 1)} is available"):
        Engine.load(tiny_model_dir("llama"), device="cpu")
    monkeypatch.setattr(host_memory, "meminfo_bytes", lambda field: need if field == "MemAvailable" else None)
    Engine.load(tiny_model_dir("llama"), device="cpu")


def test_vramshard_plan_says_what_loading_takes_of_host_memory(monkeypatch, capsys):
    import json as json_module

    from vramshard import host_memory
    from vramshard.cli.main import main
    from vramshard.engine import host_bytes_to_load
    from vramshard.shapes import shape_model
    from vramshard.units import format_bytes

    need = host_bytes_to_load(shape_model("llama3-8b"))
    for available, refused in ((need, False), (need - 1, True)):
        monkeypatch.setattr(host_memory, "meminfo_bytes", lambda field: available if field == "MemAvailable" else None)
        assert main(["plan", "--shape", "llama3-8b", "--vram", "4GiB", "--ctx", "1024", "--tiers", "1",
                     "--profile", "docs/profiles/h200-run26b.json", "--json"]) == 0
        note = next(n for n in json_module.loads(capsys.readouterr().out)["notes"] if n.startswith("host memory"))
        assert f"loading takes {format_bytes(need)}" in note and f"{format_bytes(available)} available" in note
        assert ("loading would be refused" in note) == refused
