"""Tokenizer, chat template and streaming text helpers.

:class:`Tokenizer` wraps a ``tokenizers.Tokenizer`` (the Rust library behind Hugging Face's
fast tokenizers) and renders the model's chat template with jinja2 the way transformers does.
It is built from a model directory (``tokenizer.json`` + ``tokenizer_config.json``) or from the
tokenizer a GGUF file embeds (:meth:`Tokenizer.from_gguf_spec`).

A model without a chat template cannot be chatted with: :meth:`Tokenizer.apply_chat_template`
raises :class:`InvalidInputError` suggesting a raw-text prompt instead of guessing a format the
model was never trained on.

Streaming helpers: :class:`StreamDecoder` turns token ids into text piece by piece without ever
emitting half a UTF-8 character; :func:`find_stop`, :func:`stop_prefix_len` and
:class:`StopStringFilter` cut the text at stop strings and hold back what could begin one.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Sequence

import tokenizers
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from ..errors import InvalidInputError, ModelLoadError

log = logging.getLogger(__name__)

# Split regexes of llama.cpp's BPE pre-tokenizer names (tokenizer.ggml.pre), as the matching
# Hugging Face tokenizer.json files write them. Unknown names fall back to GPT-2's ByteLevel split.
_GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_PATTERN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                   r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                   r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_PATTERNS = {
    "llama-bpe": _LLAMA3_PATTERN,
    "llama3": _LLAMA3_PATTERN,
    "smaug-bpe": _LLAMA3_PATTERN,
    "qwen2": _QWEN2_PATTERN,
    "deepseek-r1-qwen": _QWEN2_PATTERN,
    "tekken": _TEKKEN_PATTERN,
    "gpt-2": _GPT2_PATTERN,
}
# llama.cpp's GGUF token types.
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4


class Tokenizer:
    """Text ↔ token ids, special tokens, and the model's chat template."""

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token: str | None = None,
                 eos_token: str | None = None, eos_token_ids: Iterable[int] = (),
                 chat_template: str | None = None, add_bos_token: bool = False):
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        ids = set(int(i) for i in eos_token_ids)
        if eos_token and backend.token_to_id(eos_token) is not None:
            ids.add(backend.token_to_id(eos_token))
        self.eos_token_ids: set[int] = ids
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """Load ``tokenizer.json`` and the optional ``tokenizer_config.json``,
        ``chat_template.jinja`` and ``generation_config.json`` of a model directory."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(
                f"no tokenizer.json in {str(path)!r}; add the model's tokenizer files "
                "or give the prompt as token ids (--ids)"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust library raises a bare Exception
            raise ModelLoadError(f"{str(tokenizer_file)!r} is not a valid tokenizer file: {exc}") from None
        config = _read_json(path / "tokenizer_config.json")
        generation = _read_json(path / "generation_config.json")
        template = config.get("chat_template")
        if (path / "chat_template.json").is_file():
            template = _read_json(path / "chat_template.json").get("chat_template", template)
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        return cls(
            backend,
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
            eos_token_ids=_as_ids(generation.get("eos_token_id")),
            chat_template=_default_template(template),
            add_bos_token=bool(config.get("add_bos_token", False)),
        )

    @classmethod
    def from_gguf_spec(cls, spec: dict) -> "Tokenizer":
        """Build a byte-level BPE tokenizer from the tokenizer a GGUF file embeds.

        ``spec`` keys: ``model`` (only ``"gpt2"``, byte-level BPE, is supported), ``tokens``
        (strings in id order), ``merges`` (``"a b"`` strings), ``token_types`` (llama.cpp types;
        3 = control → special token), ``bos_token_id``, ``eos_token_id``, ``chat_template``,
        ``pre`` (llama.cpp pre-tokenizer name) and optionally ``add_bos_token`` and
        ``pre_tokenizer`` (the exact HF pre-tokenizer JSON, which vramshard's GGUF writer stores;
        it wins over ``pre``).
        """
        kind = spec.get("model", "gpt2")
        if kind != "gpt2":
            raise ModelLoadError(
                f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2'); "
                "run from token ids (--ids) or use the Hugging Face model directory"
            )
        tokens = [str(t) for t in spec.get("tokens") or []]
        if not tokens:
            raise ModelLoadError("the GGUF file's tokenizer has no tokens (tokenizer.ggml.tokens)")
        merges = [tuple(m.split(" ", 1)) for m in spec.get("merges") or []]
        pre = str(spec.get("pre") or "default")
        pattern = PRE_TOKENIZER_PATTERNS.get(pre)
        vocab = {token: index for index, token in enumerate(tokens)}
        # Llama 3 tokenizers look whole words up before merging (tokenizer.json "ignore_merges").
        model = BPE(vocab=vocab, merges=merges, ignore_merges=pattern is _LLAMA3_PATTERN)
        backend = tokenizers.Tokenizer(model)
        if pattern is None:
            if pre not in ("default", "gpt2"):
                log.warning("unknown GGUF pre-tokenizer %r; using GPT-2's split", pre)
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        else:
            backend.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])
        if isinstance(spec.get("pre_tokenizer"), dict):
            backend = _with_pre_tokenizer(backend, spec["pre_tokenizer"])
        backend.decoder = decoders.ByteLevel()
        types = list(spec.get("token_types") or [])
        special = [AddedToken(tokens[i], special=True, normalized=False)
                   for i, kind in enumerate(types) if kind == _TOKEN_CONTROL]
        user = [AddedToken(tokens[i], special=False, normalized=False)
                for i, kind in enumerate(types) if kind == _TOKEN_USER_DEFINED]
        backend.add_special_tokens(special)
        backend.add_tokens(user)
        bos_id, eos_id = (None if spec.get(k) is None else int(spec[k]) for k in ("bos_token_id", "eos_token_id"))
        bos = tokens[bos_id] if bos_id is not None and 0 <= bos_id < len(tokens) else None
        eos = tokens[eos_id] if eos_id is not None and 0 <= eos_id < len(tokens) else None
        add_bos = bool(spec.get("add_bos_token", False)) and bos is not None
        if add_bos:
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)])
        return cls(backend, bos_token=bos, eos_token=eos, chat_template=spec.get("chat_template") or None,
                   add_bos_token=add_bos)

    # ------------------------------------------------------------------ text <-> ids
    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` a BOS token where the model wants one."""
        if not isinstance(text, str):
            raise InvalidInputError(f"text to encode must be a string, got {type(text).__name__}")
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens (BOS, EOS, chat markers) left out unless asked for."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ chat
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}]``) with the model's chat template.

        Renders as transformers does (sandboxed jinja2, trim_blocks, lstrip_blocks, ``tojson``,
        ``raise_exception``, ``strftime_now``); extra keyword arguments become template variables.
        Encode the result with ``add_special_tokens=False``: the template writes BOS itself.
        """
        if not self.chat_template:
            raise InvalidInputError(
                "this model's tokenizer has no chat template; give the prompt as raw text "
                "(vramshard run MODEL -p TEXT, without --chat)"
            )
        variables = {"tools": None, "documents": None}
        if self.bos_token is not None:
            variables["bos_token"] = self.bos_token
        if self.eos_token is not None:
            variables["eos_token"] = self.eos_token
        variables.update(kwargs)
        import jinja2

        try:
            return _compile_template(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as exc:
            raise InvalidInputError(f"the chat template refused these messages: {exc}") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        """Token ids of the rendered chat (the template supplies the special tokens)."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)


# ---------------------------------------------------------------------- streaming
class StreamDecoder:
    """Incremental detokenizer: feed ids one at a time, get only the new, complete text.

    Decodes a short window of ids (from the last emitted boundary) and emits the part beyond
    what was already emitted, unless it ends in U+FFFD — an incomplete UTF-8 character from a
    byte-level or byte-fallback token — in which case it waits for the next id. Decoding a
    window rather than single ids keeps tokenizers that drop a leading space (SentencePiece's
    Metaspace) right. The concatenation of every ``feed`` and the final ``flush`` equals
    ``tokenizer.decode(all_ids)``.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # window start: the text of ids[_prefix:_read] was emitted already
        self._read = 0

    def feed(self, token_id: int) -> str:
        """Add one id; return the text it completes ("" while a character is still partial)."""
        self.ids.append(int(token_id))
        decode = self.tokenizer.decode
        done = decode(self.ids[self._prefix:self._read], self.skip_special_tokens)
        text = decode(self.ids[self._prefix:], self.skip_special_tokens)
        if len(text) > len(done) and not text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return text[len(done):]
        return ""

    def flush(self) -> str:
        """The text still held back at the end of the stream (may contain U+FFFD)."""
        decode = self.tokenizer.decode
        done = decode(self.ids[self._prefix:self._read], self.skip_special_tokens)
        text = decode(self.ids[self._prefix:], self.skip_special_tokens)
        self._prefix = self._read = len(self.ids)
        return text[len(done):]


def find_stop(text: str, stop_strings: Iterable[str]) -> int | None:
    """Index in ``text`` where the earliest stop string begins, or None."""
    found = [i for s in stop_strings if s and (i := text.find(s)) >= 0]
    return min(found) if found else None


def stop_prefix_len(text: str, stop_strings: Iterable[str]) -> int:
    """Length of the longest end of ``text`` that is the beginning of a stop string.

    While streaming, that many characters must be held back: the next token may complete a stop.
    """
    hold = 0
    for stop in stop_strings:
        for n in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:n]):
                hold = n
                break
    return hold


class StopStringFilter:
    """Streams text through, cut before the first stop string.

    ``feed`` returns the text safe to show now; ``stopped`` turns True once a stop string is
    seen (everything from it on is dropped) and ``hit`` names it; ``flush`` returns what was
    held back at the end.
    """

    def __init__(self, stop_strings: Iterable[str] = ()):
        self.stop_strings = [s for s in stop_strings if s]
        self.hit: str | None = None
        self._pending = ""

    @property
    def stopped(self) -> bool:
        return self.hit is not None

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        pending = self._pending + text
        at = find_stop(pending, self.stop_strings)
        if at is not None:
            self.hit = next(s for s in self.stop_strings if pending.startswith(s, at))
            self._pending = ""
            return pending[:at]
        keep = stop_prefix_len(pending, self.stop_strings)
        self._pending = pending[len(pending) - keep:] if keep else ""
        return pending[:len(pending) - keep]

    def flush(self) -> str:
        text, self._pending = ("" if self.stopped else self._pending), ""
        return text


# ---------------------------------------------------------------------- helpers
@lru_cache(maxsize=8)
def _compile_template(template: str):
    """A jinja2 template in the sandboxed environment transformers renders chat templates in."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """``{% generation %}...{% endgeneration %}`` marks assistant text for training; render as is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja2's own tojson escapes HTML characters, which chat templates do not expect.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ModelLoadError(f"the model's chat template is not valid jinja2: {exc}") from None


def _with_pre_tokenizer(backend: tokenizers.Tokenizer, pre_tokenizer: dict) -> tokenizers.Tokenizer:
    """``backend`` with its pre-tokenizer replaced by one given as tokenizer.json data."""
    data = json.loads(backend.to_str())
    data["pre_tokenizer"] = pre_tokenizer
    try:
        return tokenizers.Tokenizer.from_str(json.dumps(data))
    except Exception as exc:  # the Rust library raises a bare Exception
        raise ModelLoadError(f"the GGUF file's stored pre-tokenizer is invalid: {exc}") from None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{str(path)!r} is not valid JSON: {exc}") from None
    return data if isinstance(data, dict) else {}


def _token_text(value) -> str | None:
    """A special token from tokenizer_config.json: a string or a serialized AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _default_template(template) -> str | None:
    """tokenizer_config.json may hold one template or a list of named ones; take "default"."""
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return template or None
