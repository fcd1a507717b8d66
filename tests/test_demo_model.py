"""The built-in demo model: a real Qwen3 checkpoint that transformers loads as is, built atomically."""

import json

import pytest
import torch

from vramshard import demo_model
from vramshard.demo_model import DEMO_VERSION, MODEL_CONFIG, ensure_demo_model
from vramshard.loading.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return ensure_demo_model(tmp_path_factory.mktemp("cache"))


def test_layout_and_reuse(demo_dir):
    assert demo_dir.name == f"demo-{DEMO_VERSION}"
    names = {p.name for p in demo_dir.iterdir()}
    assert names == {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                     "generation_config.json"}
    assert [p.name for p in demo_dir.parent.iterdir()] == [demo_dir.name]  # no staging dir left
    stamp = (demo_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_model(demo_dir.parent) == demo_dir
    assert (demo_dir / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt


def test_default_location_is_user_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VRAMSHARD_CACHE", str(tmp_path))
    monkeypatch.setattr(demo_model, "write_weights", lambda config, directory: None)  # keep it quick
    assert ensure_demo_model() == tmp_path / f"demo-{DEMO_VERSION}"


def test_transformers_loads_it(demo_dir):
    model, info = transformers.Qwen3ForCausalLM.from_pretrained(demo_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    config = model.config
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(config, key) == MODEL_CONFIG[key], key
    assert model.dtype == torch.bfloat16
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    embed = model.model.embed_tokens.weight.float()
    assert 0.015 < embed.std().item() < 0.025
    assert torch.all(model.model.norm.weight == 1)


def test_tokenizer_matches_transformers(demo_dir):
    ours = Tokenizer.from_dir(demo_dir)
    hf = transformers.AutoTokenizer.from_pretrained(demo_dir)
    config = json.loads((demo_dir / "config.json").read_text())
    assert config["vocab_size"] == ours.vocab_size == len(hf)
    assert 1500 <= ours.vocab_size <= 2000
    for text in ("The weights are random.", "héllo 世界 🙂", "<|im_start|>user\nhi<|im_end|>"):
        assert ours.encode(text) == hf.encode(text)
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert ours.apply_chat_template(messages) == hf.apply_chat_template(messages, tokenize=False,
                                                                        add_generation_prompt=True)
    assert ours.eos_token_ids == {hf.convert_tokens_to_ids("<|im_end|>"), hf.convert_tokens_to_ids("<|endoftext|>")}


def test_build_is_deterministic(demo_dir, tmp_path):
    again = ensure_demo_model(tmp_path)
    for name in ("tokenizer.json", "model.safetensors", "config.json"):
        assert (again / name).read_bytes() == (demo_dir / name).read_bytes(), name


def test_interrupted_build_leaves_nothing(tmp_path, monkeypatch):
    def fail(config, directory):
        (directory / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(demo_model, "write_weights", fail)
    with pytest.raises(KeyboardInterrupt):
        ensure_demo_model(tmp_path)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    assert (ensure_demo_model(tmp_path) / "model.safetensors").stat().st_size > 1_000_000


def test_vramshard_engine_matches_transformers(demo_dir):
    engine_module = pytest.importorskip("vramshard.engine")
    engine = engine_module.Engine.load(demo_dir, device="cpu", dtype="float32")
    model = transformers.Qwen3ForCausalLM.from_pretrained(demo_dir, dtype=torch.float32)
    ids = Tokenizer.from_dir(demo_dir).encode("The model is cut into sub-layers.")
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(engine.logits(ids), expected, rtol=1e-4, atol=1e-4)
