"""GGUF reading/writing: round trips of tiny random transformers models of every architecture."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from vramshard.cli.main import main as cli_main  # noqa: E402
from vramshard.config import RopeArgs  # noqa: E402
from vramshard.errors import ModelLoadError, UnsupportedArchitectureError  # noqa: E402
from vramshard.loading import gguf_names  # noqa: E402
from vramshard.loading.checkpoint import TensorInfo, TensorSource, open_checkpoint  # noqa: E402
from vramshard.loading.gguf_io import read_gguf, write_gguf, write_hf_dir  # noqa: E402
from vramshard.models import model_args  # noqa: E402

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0}
SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2)

# name → (config class, model class, config kwargs)
MODELS = {
    "llama_llama3_tied_gqa": ("LlamaConfig", "LlamaForCausalLM",
                              dict(SMALL, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                   rope_parameters=LLAMA3_ROPE, max_position_embeddings=256)),
    "llama_odd_heads_mqa": ("LlamaConfig", "LlamaForCausalLM",
                            dict(SMALL, hidden_size=24, num_attention_heads=3, num_key_value_heads=1)),
    "mistral_head_dim": ("MistralConfig", "MistralForCausalLM",
                         dict(SMALL, num_attention_heads=4, num_key_value_heads=2, head_dim=16)),
    "qwen2_bias_tied": ("Qwen2Config", "Qwen2ForCausalLM",
                        dict(SMALL, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3_qknorm_mqa": ("Qwen3Config", "Qwen3ForCausalLM",
                         dict(SMALL, num_attention_heads=4, num_key_value_heads=1, head_dim=8,
                              tie_word_embeddings=False)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(SMALL, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=12, norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(SMALL, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                     num_experts_per_tok=2)),
    "qwen2_moe_shared": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                         dict(SMALL, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                              num_experts_per_tok=2, moe_intermediate_size=12, shared_expert_intermediate_size=20,
                              mlp_only_layers=[1])),
    "olmoe_clip": ("OlmoeConfig", "OlmoeForCausalLM",
                   dict(SMALL, num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                        clip_qkv=4.0)),
}
LLAMA_FAMILY = ("llama_llama3_tied_gqa", "llama_odd_heads_mqa", "mistral_head_dim", "mixtral")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """Builds (once per module) the tiny HF model directory of a name in MODELS."""
    made: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in made:
            config_cls, model_cls, kwargs = MODELS[name]
            torch.manual_seed(0)
            config = getattr(transformers, config_cls)(**kwargs)
            model = getattr(transformers, model_cls)(config)
            with torch.no_grad():  # random norms, biases too: a swapped tensor must show
                for param in model.parameters():
                    param.normal_()
            made[name] = tmp_path_factory.mktemp(name)
            model.save_pretrained(made[name])
        return made[name]

    return make


def _assert_same_tensors(src, back, cast: torch.dtype | None = None) -> None:
    assert set(back.tensors) == set(src.tensors) - ({"lm_head.weight"} if src.config.get("tie_word_embeddings") else set())
    for name in back.tensors:
        expected, got = src.tensors.load(name), back.tensors.load(name)
        assert got.shape == expected.shape, name
        if cast is not None and expected.dim() >= 2 and not name.endswith("mlp.gate.weight"):
            expected = expected.to(cast)
            assert got.dtype == cast, name
        assert torch.equal(got.to(expected.dtype), expected), name


def _essential(config: dict) -> dict:
    args = model_args(config)
    return {k: v for k, v in args.__dict__.items() if k != "dtype"}


@pytest.mark.parametrize("name", list(MODELS))
def test_hf_to_gguf_round_trip(name, model_dir, tmp_path):
    src = open_checkpoint(model_dir(name))
    out = tmp_path / "model.gguf"
    write_gguf(out, src)
    back = open_checkpoint(out)  # dispatches to read_gguf
    _assert_same_tensors(src, back)
    assert _essential(back.config) == _essential(src.config)
    for key in ("architectures", "model_type", "vocab_size", "tie_word_embeddings", "num_key_value_heads",
                "max_position_embeddings", "bos_token_id", "eos_token_id"):
        assert back.config.get(key) == src.config.get(key), key
    assert RopeArgs.from_config(back.config) == RopeArgs.from_config(src.config)

    # The file as llama.cpp sees it: arch, GGUF names, dims listed fastest-first.
    reader = gguf.GGUFReader(out)
    spec = gguf_names.spec_for_config(src.config)
    arch_field = reader.fields["general.architecture"]
    assert bytes(arch_field.parts[arch_field.data[0]]).decode() == spec.gguf_arch
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}
    hidden, vocab = src.config["hidden_size"], src.config["vocab_size"]
    assert shapes["token_embd.weight"] == (hidden, vocab)
    assert shapes["blk.1.attn_norm.weight"] == (hidden,)
    assert ("output.weight" in shapes) != bool(src.config.get("tie_word_embeddings"))
    q = src.tensors["model.layers.0.self_attn.q_proj.weight"].shape
    assert shapes["blk.0.attn_q.weight"] == tuple(reversed(q))
    if spec.experts is not None:
        n_exp, ff = 4, src.config.get("moe_intermediate_size") or src.config["intermediate_size"]
        assert shapes["blk.0.ffn_gate_exps.weight"] == (hidden, ff, n_exp)
        assert shapes["blk.0.ffn_down_exps.weight"] == (ff, hidden, n_exp)
        assert shapes["blk.0.ffn_gate_inp.weight"] == (hidden, n_exp)
    if name == "qwen2_moe_shared":  # llama.cpp's names for the shared expert and its gate
        shared = src.config["shared_expert_intermediate_size"]
        assert shapes["blk.0.ffn_gate_shexp.weight"] == (hidden, shared)
        assert shapes["blk.0.ffn_down_shexp.weight"] == (shared, hidden)
        assert shapes["blk.0.ffn_gate_inp_shexp.weight"] == (hidden, 1)
        assert "blk.1.ffn_gate.weight" in shapes and "blk.1.ffn_gate_exps.weight" not in shapes  # mlp_only_layers
    if name == "qwen2_bias_tied":
        assert "blk.0.attn_q.bias" in shapes and back.config["attention_bias"] is True
    if name == "qwen3_qknorm_mqa":
        assert "blk.0.attn_q_norm.weight" in shapes
    if name == "olmoe_clip":  # q/k norms over the whole projections; the clamp as llama.cpp names it
        assert shapes["blk.0.attn_q_norm.weight"] == (hidden,)
        assert back.config["clip_qkv"] == 4.0 and "olmoe.attention.clamp_kqv" in reader.fields
    if name == "llama_llama3_tied_gqa":  # llama.cpp's form of Llama 3 rope scaling
        expected = gguf_names.llama3_rope_factors(LLAMA3_ROPE, 500000.0, 8)
        freqs = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        np.testing.assert_array_equal(np.asarray(freqs.data), expected.numpy())


def _llama_cpp_permuted(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's row order, written out index by index: within each head, row pairs interleave
    the first and second rotary halves (new row 2j+t = old row t*d/2 + j)."""
    head_dim = weight.shape[0] // n_head
    out = torch.empty_like(weight)
    for h in range(n_head):
        for j in range(head_dim // 2):
            for t in (0, 1):
                out[h * head_dim + 2 * j + t] = weight[h * head_dim + t * head_dim // 2 + j]
    return out


@pytest.mark.parametrize("name", ["llama_llama3_tied_gqa", "llama_odd_heads_mqa", "mistral_head_dim", "qwen2_bias_tied"])
def test_qk_permutation_matches_llama_cpp(name, model_dir, tmp_path):
    src = open_checkpoint(model_dir(name))
    write_gguf(tmp_path / "m.gguf", src)
    stored = {t.name: torch.from_numpy(np.array(t.data)) for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    heads, kv_heads = src.config["num_attention_heads"], src.config["num_key_value_heads"]
    for proj, gguf_name, n in (("q_proj", "attn_q", heads), ("k_proj", "attn_k", kv_heads), ("v_proj", "attn_v", 0)):
        hf = src.tensors.load(f"model.layers.1.self_attn.{proj}.weight")
        got = stored[f"blk.1.{gguf_name}.weight"]
        if name in LLAMA_FAMILY and n:
            assert torch.equal(got, _llama_cpp_permuted(hf, n)), proj
            assert not torch.equal(got, hf)
        else:  # Qwen2/3 are stored as in HF; v is never permuted
            assert torch.equal(got, hf), proj


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "qwen2_bias_tied", "qwen2_moe_shared", "olmoe_clip"])
def test_gguf_to_hf_to_gguf_is_identical(name, model_dir, tmp_path):
    first = tmp_path / "a.gguf"
    write_gguf(first, open_checkpoint(model_dir(name)), dtype=torch.bfloat16)
    write_hf_dir(tmp_path / "hf", read_gguf(first))
    hf = open_checkpoint(tmp_path / "hf")
    _assert_same_tensors(read_gguf(first), hf)
    write_gguf(tmp_path / "b.gguf", hf)
    assert (tmp_path / "b.gguf").read_bytes() == first.read_bytes()


@pytest.mark.parametrize("dtype, ggml", [(torch.bfloat16, "BF16"), (torch.float16, "F16")])
def test_storage_dtype(dtype, ggml, model_dir, tmp_path):
    src = open_checkpoint(model_dir("qwen3_moe"))
    write_gguf(tmp_path / "m.gguf", src, dtype=dtype)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    assert types["blk.0.attn_q.weight"] == ggml and types["blk.0.ffn_up_exps.weight"] == ggml
    assert types["blk.0.attn_norm.weight"] == "F32" and types["blk.0.ffn_gate_inp.weight"] == "F32"
    back = read_gguf(tmp_path / "m.gguf")
    _assert_same_tensors(src, back, cast=dtype)
    assert back.config["dtype"] == str(dtype).removeprefix("torch.")


def test_experts_are_zero_copy_views(model_dir, tmp_path):
    write_gguf(tmp_path / "m.gguf", open_checkpoint(model_dir("mixtral")))
    back = read_gguf(tmp_path / "m.gguf")
    e0 = back.tensors.load("model.layers.0.block_sparse_moe.experts.0.w1.weight")
    e1 = back.tensors.load("model.layers.0.block_sparse_moe.experts.1.w1.weight")
    assert e1.data_ptr() - e0.data_ptr() == e0.numel() * e0.element_size()
    assert e0.untyped_storage().data_ptr() == e1.untyped_storage().data_ptr()


def test_foreign_gguf_without_vramshard_metadata(model_dir, tmp_path, monkeypatch):
    """A file as llama.cpp writes it (no vramshard.hf_config): config rebuilt from GGUF keys alone."""
    monkeypatch.setattr(gguf_names, "config_extras", lambda config: "{}")
    for name in ("llama_llama3_tied_gqa", "mixtral", "qwen3_moe", "qwen2_moe_shared", "olmoe_clip"):
        src = open_checkpoint(model_dir(name))
        write_gguf(tmp_path / f"{name}.gguf", src)
        back = read_gguf(tmp_path / f"{name}.gguf")
        assert back.config["architectures"] == src.config["architectures"]
        _assert_same_tensors(src, back)
        got, want = _essential(back.config), _essential(src.config)
        got_rope, want_rope = got.pop("rope"), want.pop("rope")
        assert got == want
        assert got_rope.type == want_rope.type and got_rope.theta == want_rope.theta
        if want_rope.type == "llama3":  # fitted parameters give the same frequencies
            torch.testing.assert_close(
                gguf_names.llama3_rope_factors(back.config["rope_parameters"], got_rope.theta, 8),
                gguf_names.llama3_rope_factors(src.config["rope_parameters"], want_rope.theta, 8))


def test_a_one_dimensional_shared_expert_gate_loads_as_hf_one_row(model_dir, tmp_path):
    """llama.cpp reads ``ffn_gate_inp_shexp`` as ``[n_embd]``; a file that stores it so loads as HF's [1, D]."""
    src = open_checkpoint(model_dir("qwen2_moe_shared"))
    gate = "model.layers.0.mlp.shared_expert_gate.weight"
    infos = {n: src.tensors[n] for n in src.tensors}
    infos[gate] = TensorInfo((infos[gate].shape[1],), infos[gate].dtype)
    flat = TensorSource(infos, lambda n: src.tensors.load(n).reshape(-1) if n == gate else src.tensors.load(n))
    write_gguf(tmp_path / "m.gguf", dataclasses.replace(src, tensors=flat))
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    assert shapes["blk.0.ffn_gate_inp_shexp.weight"] == (src.config["hidden_size"],)
    back = read_gguf(tmp_path / "m.gguf")
    assert torch.equal(back.tensors.load(gate), src.tensors.load(gate))  # [1, D]


@pytest.mark.parametrize("params", [
    dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192),
    dict(factor=32.0, low_freq_factor=2.0, high_freq_factor=6.0, original_max_position_embeddings=8192),
])
def test_llama3_params_recovered_from_rope_freqs(params):
    factors = gguf_names.llama3_rope_factors(params, 500000.0, 128)
    fitted = gguf_names.llama3_params_from_factors(factors, 500000.0, 128, 8192)
    assert fitted["rope_type"] == "llama3"
    for key, value in params.items():
        assert fitted[key] == pytest.approx(value, rel=1e-4), key


# ---------------------------------------------------------------- tokenizer

def _save_tokenizer(directory: Path) -> "object":
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|bos|>", "<|eos|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, hello vramshard", "ünïcödé text"] * 20
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens(["<extra>"])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|bos|>", "eos_token": "<|eos|>", "add_bos_token": True,
        "chat_template": "{% for m in messages %}<|bos|>{{ m['content'] }}<|eos|>{% endfor %}"}))
    return tok


def test_gpt2_tokenizer_round_trip(tmp_path):
    tok_dir = tmp_path / "src"
    tok_dir.mkdir()
    tok = _save_tokenizer(tok_dir)
    n_vocab = tok.get_vocab_size()
    config = transformers.LlamaConfig(vocab_size=n_vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, bos_token_id=None,
                                      eos_token_id=None)
    transformers.LlamaForCausalLM(config).save_pretrained(tok_dir)
    src = open_checkpoint(tok_dir)
    assert src.tokenizer_dir is not None
    write_gguf(tmp_path / "m.gguf", src)
    spec = read_gguf(tmp_path / "m.gguf").tokenizer_spec

    vocab = tok.get_vocab()
    assert spec["model"] == "gpt2"
    assert spec["tokens"] == sorted(vocab, key=vocab.get)
    saved = json.loads((tok_dir / "tokenizer.json").read_text())["model"]["merges"]
    assert spec["merges"] == [m if isinstance(m, str) else " ".join(m) for m in saved] and spec["merges"]
    assert spec["bos_token_id"] == vocab["<|bos|>"] and spec["eos_token_id"] == vocab["<|eos|>"]
    types = spec["token_types"]
    assert types[vocab["<|bos|>"]] == types[vocab["<|eos|>"]] == 3  # CONTROL
    assert types[vocab["<extra>"]] == 4 and types[vocab["the"]] == 1  # USER_DEFINED, NORMAL
    assert "<|bos|>{{ m['content'] }}" in spec["chat_template"]
    assert spec["add_bos_token"] is True
    assert spec["pre"] == "gpt-2" and set(spec) >= {"model", "tokens", "merges", "token_types", "bos_token_id",
                                         "eos_token_id", "chat_template", "pre"}

    # GGUF → HF directory: the rebuilt tokenizer.json tokenizes as the original.
    from tokenizers import Tokenizer

    from vramshard.loading.tokenizer import Tokenizer as VsTokenizer

    text = "hello <|eos|>the quick ünïcödé fox<extra>"
    assert VsTokenizer.from_gguf_spec(spec).encode(text) == [vocab["<|bos|>"], *tok.encode(text).ids]

    write_hf_dir(tmp_path / "hf", read_gguf(tmp_path / "m.gguf"))
    rebuilt = Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json"))
    assert rebuilt.encode(text).ids == tok.encode(text).ids
    tok_config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == spec["chat_template"] and tok_config["eos_token"] == "<|eos|>"
    write_gguf(tmp_path / "again.gguf", open_checkpoint(tmp_path / "hf"))
    assert read_gguf(tmp_path / "again.gguf").tokenizer_spec == spec


# ---------------------------------------------------------------- errors

@pytest.mark.parametrize("keep", [0.02, 0.3, 0.9])
def test_truncated_file(keep, model_dir, tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, open_checkpoint(model_dir("qwen2_bias_tied")))
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelLoadError, match=str(path)):
        open_checkpoint(path)


def test_garbage_file(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ModelLoadError, match="junk.gguf"):
        read_gguf(path)
    path.write_bytes(b"GGUF" + np.random.default_rng(1).bytes(4096))  # right magic, garbage after
    with pytest.raises(ModelLoadError, match="junk.gguf"):
        read_gguf(path)


def test_unknown_architecture(tmp_path):
    path = tmp_path / "falcon.gguf"
    writer = gguf.GGUFWriter(path, "falcon")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedArchitectureError, match=r"'falcon'.*llama.*qwen2.*qwen3.*qwen3moe"):
        read_gguf(path)


def test_quantized_tensor_refused(model_dir, tmp_path):
    path = tmp_path / "q.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((4, 34), dtype=np.uint8),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"blk\.0\.attn_q\.weight.*Q8_0.*F32/F16/BF16"):
        read_gguf(path)


# ---------------------------------------------------------------- CLI

def test_cli_convert(model_dir, tmp_path, capsys):
    src = model_dir("qwen3_qknorm_mqa")
    out = tmp_path / "m.gguf"
    assert cli_main(["convert", str(src), str(out), "--dtype", "f16"]) == 0
    assert read_gguf(out).tensors["model.layers.0.mlp.up_proj.weight"].dtype == torch.float16
    assert cli_main(["convert", str(src), str(out)]) == 3  # exists, no --force
    assert "--force" in capsys.readouterr().err
    assert cli_main(["convert", str(src), str(out), "--force"]) == 0
    assert read_gguf(out).tensors["model.layers.0.mlp.up_proj.weight"].dtype == torch.float32
    assert cli_main(["convert", str(out), str(tmp_path / "hf")]) == 0
    _assert_same_tensors(read_gguf(out), open_checkpoint(tmp_path / "hf"))
    assert cli_main(["convert", str(tmp_path / "missing"), str(tmp_path / "x.gguf")]) == 2
