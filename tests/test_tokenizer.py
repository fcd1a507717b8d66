"""Tokenizer, chat template, streaming decoder and stop strings, checked against transformers."""

import json
import shutil

import pytest
from tokenizers import Tokenizer as HFBackend
from tokenizers import decoders, models, normalizers

from vramshard.demo_model import train_tokenizer, write_tokenizer_files
from vramshard.errors import InvalidInputError, ModelLoadError
from vramshard.loading.tokenizer import (StopStringFilter, StreamDecoder, Tokenizer, find_stop,
                                         stop_prefix_len)

transformers = pytest.importorskip("transformers")

SAMPLES = [
    "Hello world",
    "vramshard runs language models whose weights do not fit.",
    "héllo 世界 🙂",
    "  leading spaces, trailing   \n\nnew lines\tand tabs",
    "It's 2048 tokens; they'll stream at 55.5 GB/s!",
    "Ends here.\nNext line",  # Qwen2's split keeps ".\n" together, GPT-2's does not
    "<|im_start|>user\nhi<|im_end|>\n",
    "",
]
MULTIBYTE = "héllo 世界 🙂 — naïve café, Ελληνικά, русский, 日本語のテキスト 👍🏽"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(train_tokenizer(), path)
    return path


@pytest.fixture(scope="module")
def tok(tok_dir):
    return Tokenizer.from_dir(tok_dir)


@pytest.fixture(scope="module")
def hf(tok_dir):
    return transformers.AutoTokenizer.from_pretrained(tok_dir)


def _copy_dir(src, dst, config_changes=None, drop=()):
    shutil.copytree(src, dst)
    if config_changes is not None:
        config = json.loads((dst / "tokenizer_config.json").read_text())
        config.update(config_changes)
        for key in drop:
            config.pop(key, None)
        (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


# ---------------------------------------------------------------------- encode / decode
@pytest.mark.parametrize("text", SAMPLES + [MULTIBYTE])
def test_encode_decode_match_transformers(tok, hf, text):
    ids = tok.encode(text)
    assert ids == hf.encode(text)
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)


def test_special_tokens_and_sizes(tok, hf):
    assert tok.vocab_size == len(hf)
    im_end = tok.backend.token_to_id("<|im_end|>")
    eot = tok.backend.token_to_id("<|endoftext|>")
    assert tok.eos_token_ids == {im_end, eot}  # tokenizer_config eos + generation_config list
    assert tok.bos_token_id is None
    assert tok.encode("a<|im_end|>b", add_special_tokens=False)[1] == im_end
    assert tok.decode([im_end]) == ""


def test_eos_id_as_int_and_add_bos(tok_dir, tmp_path):
    path = _copy_dir(tok_dir, tmp_path / "t", {"bos_token": {"content": "<|endoftext|>"}, "add_bos_token": True})
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    tok = Tokenizer.from_dir(path)
    eot = tok.backend.token_to_id("<|endoftext|>")
    assert tok.eos_token_ids == {7, tok.backend.token_to_id("<|im_end|>")}
    assert tok.bos_token_id == eot
    assert tok.encode("hello")[0] == eot
    assert tok.encode("hello", add_special_tokens=False)[0] != eot


# ---------------------------------------------------------------------- chat template
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo 世界"},
     {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "again"}],
]

RICH_TEMPLATE = """{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}{% set rest = messages[1:] %}{% else %}{% set rest = messages %}{% endif %}
{% if sys is defined %}SYSTEM: {{ sys }}
{% endif %}
{% for m in rest %}
  {% if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}
  {% if loop.index > 5 %}{% break %}{% endif %}
  [{{ m['role'] | upper }}] {{ m['content'] | tojson }}
{% endfor %}
{% if tools %}TOOLS {{ tools | tojson(indent=2) }}{% endif %}
{% if add_generation_prompt %}[ASSISTANT]{% if enable_thinking is defined and not enable_thinking %} /no_think{% endif %}{% endif %}"""


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chatml_template_matches_transformers(tok, hf, messages, add_generation_prompt):
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert tok.encode_chat(messages, add_generation_prompt=add_generation_prompt) == list(ids)


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_template_features_match_transformers(tok_dir, tmp_path, messages):
    path = _copy_dir(tok_dir, tmp_path / "t", {"chat_template": RICH_TEMPLATE, "bos_token": "<|endoftext|>"})
    ours, hf = Tokenizer.from_dir(path), transformers.AutoTokenizer.from_pretrained(path)
    tools = [{"type": "function", "function": {"name": "f", "description": "é <b>"}}]
    for kwargs in ({}, {"enable_thinking": False}):
        assert ours.apply_chat_template(messages, tools=tools, **kwargs) == hf.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs)
    with pytest.raises(InvalidInputError, match="bad role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_chat_template_jinja_file_wins(tok_dir, tmp_path):
    path = _copy_dir(tok_dir, tmp_path / "t")
    (path / "chat_template.jinja").write_text("{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    assert Tokenizer.from_dir(path).apply_chat_template([{"role": "user", "content": "x"}]) == "<x>"


def test_no_template_is_a_clear_error(tok_dir, tmp_path):
    path = _copy_dir(tok_dir, tmp_path / "t", {}, drop=("chat_template",))
    with pytest.raises(InvalidInputError, match="no chat template.*-p TEXT"):
        Tokenizer.from_dir(path).apply_chat_template([{"role": "user", "content": "x"}])


def test_load_errors(tok_dir, tmp_path):
    with pytest.raises(ModelLoadError, match=str(tmp_path)):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    bad = _copy_dir(tok_dir, tmp_path / "bad")
    (bad / "tokenizer_config.json").write_text("[")
    with pytest.raises(ModelLoadError, match="tokenizer_config.json"):
        Tokenizer.from_dir(bad)


# ---------------------------------------------------------------------- streaming
def _stream(tok, ids):
    decoder = StreamDecoder(tok)
    pieces = [decoder.feed(i) for i in ids]
    return pieces, decoder.flush()


@pytest.mark.parametrize("text", [MULTIBYTE, "héllo 世界 🙂", "plain ascii text"])
def test_stream_decoder_equals_full_decode(tok, text):
    ids = tok.encode(text)
    pieces, rest = _stream(tok, ids)
    assert "".join(pieces) + rest == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)
    if text != "plain ascii text":
        assert "" in pieces  # some ids carry only part of a character and were held back


def test_stream_decoder_skips_special_tokens(tok):
    ids = tok.encode_chat([{"role": "user", "content": "世界"}]) + tok.encode("🙂<|im_end|>")
    pieces, rest = _stream(tok, ids)
    assert "".join(pieces) + rest == tok.decode(ids) == "user\n世界\nassistant\n🙂"


def test_stream_decoder_byte_fallback_metaspace():
    """A Llama-2 style tokenizer: Metaspace, <0xXX> byte-fallback tokens, leading-space strip."""
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": b + 1 for b in range(256)}}
    for piece in ("▁h", "é", "llo", "▁wor", "ld", "▁"):
        vocab[piece] = len(vocab)
    backend = HFBackend(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    tok = Tokenizer(backend)
    text = "héllo world 世界🙂"
    ids = tok.encode(text)
    assert any(1 <= i <= 256 for i in ids)  # the CJK and emoji went through byte tokens
    pieces, rest = _stream(tok, ids)
    assert "".join(pieces) + rest == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


def test_flush_emits_incomplete_tail(tok):
    ids = tok.encode("🙂")
    assert len(ids) > 1
    pieces, rest = _stream(tok, ids[:-1])
    assert "".join(pieces) == "" and rest == tok.decode(ids[:-1]) and "\ufffd" in rest


# ---------------------------------------------------------------------- stop strings
def test_find_stop_and_prefix():
    assert find_stop("abc STOP def END", ["END", "STOP"]) == 4
    assert find_stop("abc", ["x", ""]) is None
    assert stop_prefix_len("hello ST", ["STOP"]) == 2
    assert stop_prefix_len("hello S", ["STOP", "Sx"]) == 1
    assert stop_prefix_len("hello", ["STOP"]) == 0
    assert stop_prefix_len("ab", ["aXb", "bY"]) == 1  # "b" could start "bY"


@pytest.mark.parametrize("chunks", [list("hello STOP world"), ["hel", "lo S", "TO", "P wor", "ld"],
                                    ["hello STOP world"]])
def test_stop_filter_cuts_and_holds_back(chunks):
    stop = StopStringFilter(["STOP", "\n\n"])
    shown = ""
    for chunk in chunks:
        out = stop.feed(chunk)
        assert "S" not in out  # never shows what may begin a stop string
        shown += out
    assert stop.stopped and stop.hit == "STOP"
    assert shown + stop.flush() == "hello "


def test_stop_filter_releases_false_alarm():
    stop = StopStringFilter(["STOP"])
    assert stop.feed("a ST") == "a "
    assert stop.feed("ART") == "START"
    assert stop.feed("x S") == "x "
    assert stop.flush() == "S" and not stop.stopped


# ---------------------------------------------------------------------- GGUF tokenizer spec
def _gguf_spec(tok_dir, pre="qwen2"):
    data = json.loads((tok_dir / "tokenizer.json").read_text())
    vocab = dict(data["model"]["vocab"])
    for added in data["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    special = {a["id"] for a in data["added_tokens"] if a["special"]}
    return {"model": "gpt2", "tokens": tokens, "merges": merges, "pre": pre,
            "token_types": [3 if i in special else 1 for i in range(len(tokens))],
            "bos_token_id": vocab["<|endoftext|>"], "eos_token_id": vocab["<|im_end|>"],
            "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}


def test_gguf_spec_equals_tokenizer_json(tok, tok_dir):
    gguf = Tokenizer.from_gguf_spec(_gguf_spec(tok_dir))
    assert gguf.vocab_size == tok.vocab_size
    for text in SAMPLES + [MULTIBYTE]:
        assert gguf.encode(text) == tok.encode(text), text
        assert gguf.decode(tok.encode(text)) == tok.decode(tok.encode(text))
    assert gguf.eos_token_ids == {tok.backend.token_to_id("<|im_end|>")}
    assert gguf.apply_chat_template([{"role": "user", "content": "x"}]) == "x"
    assert gguf.bos_token_id == tok.backend.token_to_id("<|endoftext|>")


@pytest.mark.parametrize("pre", ["llama-bpe", "default", "made-up"])
def test_gguf_spec_other_pre_tokenizers(tok_dir, pre):
    spec = dict(_gguf_spec(tok_dir, pre), add_bos_token=True)
    gguf = Tokenizer.from_gguf_spec(spec)
    ids = gguf.encode(MULTIBYTE)
    assert ids[0] == spec["bos_token_id"]
    assert gguf.decode(ids) == MULTIBYTE


def test_gguf_spec_stored_pre_tokenizer_wins(tok, tok_dir):
    stored = json.loads((tok_dir / "tokenizer.json").read_text())["pre_tokenizer"]
    gguf = Tokenizer.from_gguf_spec(dict(_gguf_spec(tok_dir, "default"), pre_tokenizer=stored))
    for text in SAMPLES + [MULTIBYTE]:
        assert gguf.encode(text) == tok.encode(text), text
    with pytest.raises(ModelLoadError, match="pre-tokenizer"):
        Tokenizer.from_gguf_spec(dict(_gguf_spec(tok_dir), pre_tokenizer={"type": "Nonsense"}))


def test_gguf_spec_errors(tok_dir):
    with pytest.raises(ModelLoadError, match="'llama'.*--ids"):
        Tokenizer.from_gguf_spec(dict(_gguf_spec(tok_dir), model="llama"))
    with pytest.raises(ModelLoadError, match="no tokens"):
        Tokenizer.from_gguf_spec({"model": "gpt2", "tokens": []})


def test_encode_rejects_non_text(tok):
    with pytest.raises(InvalidInputError, match="string"):
        tok.encode([1, 2])
