"""Reading and writing GGUF files (F32/F16/BF16 tensors), and writing HF directories.

:func:`read_gguf` memory-maps a GGUF file and presents it as a :class:`Checkpoint` in Hugging
Face terms (config dict, HF tensor names, HF row order of q/k). :func:`write_gguf` writes a
checkpoint the way llama.cpp's ``convert_hf_to_gguf.py`` would (names, merged expert tensors,
permuted q/k of Llama-family models, 1-D tensors and routers in F32), streaming one tensor at a
time. :func:`write_hf_dir` writes config.json + model.safetensors, also streaming.
Name and metadata mapping lives in :mod:`.gguf_names`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..config import RopeArgs
from ..errors import ModelLoadError
from . import gguf_names as names
from .checkpoint import Checkpoint, TensorInfo, TensorSource

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]  # (tensors done, tensors in all)

_GGML_TO_TORCH = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_TORCH_TO_GGML = {v: k for k, v in _GGML_TO_TORCH.items()}
# general.file_type values (llama.cpp's LlamaFileType): ALL_F32, MOSTLY_F16, MOSTLY_BF16.
_FILE_TYPE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 32}
_DTYPE_NAME = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
# Tokenizer files copied by write_hf_dir when the checkpoint has a tokenizer directory.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja", "generation_config.json")
_NORMAL, _CONTROL, _USER_DEFINED, _UNUSED = 1, 3, 4, 5  # llama.cpp token types


# ================================================================ reading

def read_gguf(path: str | Path) -> Checkpoint:
    """Open a GGUF file as a :class:`Checkpoint` (tensors memory-mapped, loaded lazily)."""
    import gguf

    path = Path(path)
    try:
        # "c" (copy-on-write) maps the file privately: tensors are zero-copy yet writable.
        reader = gguf.GGUFReader(path, "c")
    except Exception as exc:  # the reader raises ValueError/IndexError/KeyError on bad bytes
        raise ModelLoadError(
            f"{path} is not a readable GGUF file (truncated or corrupt: {type(exc).__name__}: {exc})"
        ) from None
    meta = {key: _field_value(field) for key, field in reader.fields.items()}
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelLoadError(f"{path} has no general.architecture; is it a GGUF model file?")
    extras = _json_object(meta.get(names.HF_EXTRAS_KEY), path)
    spec = names.spec_for_gguf(arch, int(meta.get(f"{arch}.expert_count") or 0), extras)
    n_experts = int(meta.get(f"{arch}.expert_count") or 0)

    file_size = path.stat().st_size
    stored: dict[str, torch.Tensor] = {}  # GGUF name → zero-copy view in torch (HF dim order)
    for tensor in reader.tensors:
        type_name = tensor.tensor_type.name
        if type_name not in _GGML_TO_TORCH:
            raise ModelLoadError(
                f"{path}: tensor {tensor.name!r} has type {type_name}; only F32/F16/BF16 GGUF "
                "files are supported (convert quantized models from their original weights)"
            )
        end = tensor.data_offset + tensor.n_bytes
        if end > file_size:
            raise ModelLoadError(f"{path} is truncated: tensor {tensor.name!r} ends at byte {end} "
                                 f"of a {file_size}-byte file")
        raw = reader.data[tensor.data_offset:end]
        shape = tuple(reversed([int(d) for d in tensor.shape]))  # GGUF lists dims fastest-first
        stored[tensor.name] = torch.from_numpy(raw).view(_GGML_TO_TORCH[type_name]).reshape(shape)

    rope_freqs = stored.pop(names.ROPE_FREQS, None)
    infos: dict[str, TensorInfo] = {}
    loaders: dict[str, Callable[[], torch.Tensor]] = {}
    for gguf_name, data in stored.items():
        hf_names = names.gguf_to_hf(gguf_name, spec.experts, n_experts)
        if hf_names is None:
            log.warning("%s: ignoring GGUF tensor %r (no Hugging Face counterpart)", path, gguf_name)
            continue
        if len(hf_names) > 1:  # merged experts [n_expert, ...]: expert e is the view data[e]
            if data.shape[0] != len(hf_names):
                raise ModelLoadError(f"{path}: {gguf_name!r} has {data.shape[0]} experts, "
                                     f"metadata says {len(hf_names)}")
            for e, hf_name in enumerate(hf_names):
                infos[hf_name] = TensorInfo(tuple(data.shape[1:]), data.dtype)
                loaders[hf_name] = lambda data=data, e=e: data[e]
            continue
        if gguf_name.endswith(f"{names.SHARED_GATE}.weight") and data.dim() == 1:
            data = data.view(1, -1)  # HF's one-row [1, D] (llama.cpp reads it as [D] either way)
        infos[hf_names[0]] = TensorInfo(tuple(data.shape), data.dtype)
        loaders[hf_names[0]] = lambda data=data: data
    config = names.metadata_to_config(meta, spec, extras, set(infos), rope_freqs)
    _check_qk_heads(config, infos, path)
    if spec.permute_qk:
        for hf_name in list(loaders):
            n_head = _qk_heads(hf_name, config)
            if n_head:
                loaders[hf_name] = lambda load=loaders[hf_name], n=n_head: names.unpermute_qk(load(), n)
    if config.get("vocab_size") is None and "model.embed_tokens.weight" in infos:
        config["vocab_size"] = infos["model.embed_tokens.weight"].shape[0]
    if meta.get("general.name"):
        config.setdefault("_name_or_path", meta["general.name"])
    embed = infos.get("model.embed_tokens.weight")
    config["dtype"] = _DTYPE_NAME[embed.dtype if embed else torch.float32]

    def load(name: str) -> torch.Tensor:
        return loaders[name]()

    return Checkpoint(path, config, TensorSource(infos, load), None, _tokenizer_spec(meta, path))


def _field_value(field):
    """A metadata value as Python (int, float, bool, str, or a list of them).

    Reads ReaderField.parts directly, which works across gguf package versions.
    """
    import gguf

    types = list(field.types)
    if not types:
        return None
    if types[0] == gguf.GGUFValueType.ARRAY:
        items = [field.parts[i] for i in field.data]
        if len(types) > 1 and types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(p).decode("utf-8", errors="replace") for p in items]
        if len(types) > 1 and types[-1] == gguf.GGUFValueType.ARRAY:
            return None  # nested arrays: nothing vramshard reads
        return [p.tolist()[0] for p in items]
    part = field.parts[field.data[0]]
    if types[0] == gguf.GGUFValueType.STRING:
        return bytes(part).decode("utf-8", errors="replace")
    return part.tolist()[0]


def _json_object(text, path: Path) -> dict:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path}: metadata {names.HF_EXTRAS_KEY} is not valid JSON: {exc}") from None
    return value if isinstance(value, dict) else {}


def _qk_heads(hf_name: str, config: dict) -> int:
    """Heads to (un)permute over for a q/k projection tensor; 0 for any other tensor."""
    if ".self_attn.q_proj." in hf_name:
        return int(config["num_attention_heads"])
    if ".self_attn.k_proj." in hf_name:
        return int(config.get("num_key_value_heads") or config["num_attention_heads"])
    return 0


def _check_qk_heads(config: dict, infos: dict[str, TensorInfo], path: Path) -> None:
    """q/k rows must be heads × head_dim, else the (un)permutation cannot be applied."""
    dim = names.head_dim(config)
    for name, info in infos.items():
        n_head = _qk_heads(name, config)
        if n_head and info.shape[0] != n_head * dim:
            raise ModelLoadError(f"{path}: tensor {name!r} has {info.shape[0]} rows, expected "
                                 f"{n_head} heads × head_dim {dim}")


def _tokenizer_spec(meta: dict, path: Path) -> dict | None:
    model = meta.get("tokenizer.ggml.model")
    if model is None:
        return None
    if model != "gpt2":
        log.warning("%s: tokenizer %r is not supported (only byte-level BPE, 'gpt2'); "
                    "the model runs from token ids", path, model)
        return None
    spec = {
        "model": "gpt2",
        "tokens": meta.get("tokenizer.ggml.tokens") or [],
        "merges": meta.get("tokenizer.ggml.merges") or [],
        "token_types": meta.get("tokenizer.ggml.token_type") or [],
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "padding_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "chat_template": meta.get("tokenizer.chat_template"),
        "pre": meta.get("tokenizer.ggml.pre"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
    }
    pre_tokenizer = meta.get("vramshard.tokenizer.pre_tokenizer")
    if pre_tokenizer:  # the HF pre-tokenizer JSON, present when vramshard wrote the file
        spec["pre_tokenizer"] = json.loads(pre_tokenizer)
    return spec


# ================================================================ writing GGUF

def write_gguf(path: str | Path, checkpoint: Checkpoint, dtype: torch.dtype | None = None,
               progress: Progress | None = None) -> None:
    """Write ``checkpoint`` as a GGUF file llama.cpp can read; ``dtype`` casts the matrices.

    Tensors are read, converted and written one at a time (a merged expert tensor holds one
    layer's experts), so the model is never held in memory twice. The file appears atomically.
    """
    import gguf

    if dtype is not None and dtype not in _TORCH_TO_GGML:
        raise ValueError(f"dtype must be torch.float32, float16 or bfloat16, got {dtype}")
    path = Path(path)
    config = checkpoint.config
    spec = names.spec_for_config(config)
    plan = _gguf_plan(checkpoint, spec)  # GGUF name → (HF names, torch shape)
    rope = RopeArgs.from_config(config)
    rope_freqs = None
    if rope.type == "llama3":
        params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        rope_freqs = names.llama3_rope_factors(params, rope.theta, names.head_dim(config))

    def out_dtype(gguf_name: str, source: torch.dtype, ndim: int) -> torch.dtype:
        if ndim <= 1 or gguf_name.endswith(("ffn_gate_inp.weight", f"{names.SHARED_GATE}.weight")):
            return torch.float32  # llama.cpp keeps norms, biases and routers in F32
        target = dtype or source
        return target if target in _TORCH_TO_GGML else torch.float32

    matrix_dtype = dtype or checkpoint.tensors["model.embed_tokens.weight"].dtype
    path.parent.mkdir(parents=True, exist_ok=True)
    writer_tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    writer = gguf.GGUFWriter(writer_tmp, spec.gguf_arch)
    try:
        name = Path(str(config.get("_name_or_path") or "")).name or checkpoint.path.stem or "model"
        writer.add_string("general.name", name)
        writer.add_uint32("general.file_type", _FILE_TYPE.get(matrix_dtype, 0))
        for key, value in names.config_to_metadata(config, spec).items():
            _add_value(writer, key, value)
        writer.add_string(names.HF_EXTRAS_KEY, names.config_extras(config))
        _add_tokenizer(writer, checkpoint)

        out_types: dict[str, torch.dtype] = {}
        for gguf_name, (hf_names, shape) in plan.items():
            source = checkpoint.tensors[hf_names[0]].dtype
            out_types[gguf_name] = out_dtype(gguf_name, source, len(shape))
            _add_tensor_info(writer, gguf_name, shape, out_types[gguf_name])
        if rope_freqs is not None:
            _add_tensor_info(writer, names.ROPE_FREQS, tuple(rope_freqs.shape), torch.float32)

        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        total = len(plan)
        for done, (gguf_name, (hf_names, _)) in enumerate(plan.items(), 1):
            if len(hf_names) > 1:  # one layer's experts → [n_expert, rows, cols]
                data = torch.stack([checkpoint.tensors.load(n) for n in hf_names])
            else:
                data = checkpoint.tensors.load(hf_names[0])
                n_head = _qk_heads(hf_names[0], config) if spec.permute_qk else 0
                if n_head:
                    data = names.permute_qk(data, n_head)
            writer.write_tensor_data(_as_numpy(data.to(out_types[gguf_name])))
            if progress:
                progress(done, total)
        if rope_freqs is not None:
            writer.write_tensor_data(rope_freqs.numpy())
        writer.close()
        os.replace(writer_tmp, path)
    except BaseException:
        writer.close()
        writer_tmp.unlink(missing_ok=True)
        raise


def _gguf_plan(checkpoint: Checkpoint, spec: names.ArchSpec) -> dict[str, tuple[list[str], tuple[int, ...]]]:
    """For each GGUF tensor: the HF tensors it is made of and its torch shape."""
    tied = bool(checkpoint.config.get("tie_word_embeddings", False))
    groups: dict[str, dict[int | None, str]] = {}
    for hf_name in checkpoint.tensors:
        if tied and hf_name == "lm_head.weight":
            continue  # tied: llama.cpp uses token_embd when output is absent
        target = names.hf_to_gguf(hf_name, spec.experts)
        if target is None:
            log.warning("not writing tensor %r: GGUF %s has no place for it", hf_name, spec.gguf_arch)
            continue
        gguf_name, expert = target
        groups.setdefault(gguf_name, {})[expert] = hf_name
    plan = {}
    for gguf_name, members in groups.items():
        if None in members:
            hf_name = members[None]
            plan[gguf_name] = ([hf_name], tuple(checkpoint.tensors[hf_name].shape))
            continue
        count = max(members) + 1
        missing = [e for e in range(count) if e not in members]
        if missing:
            raise ModelLoadError(f"cannot merge {gguf_name}: experts {missing} are missing")
        hf_names = [members[e] for e in range(count)]
        shapes = {tuple(checkpoint.tensors[n].shape) for n in hf_names}
        if len(shapes) != 1:
            raise ModelLoadError(f"cannot merge {gguf_name}: experts have different shapes {sorted(shapes)}")
        plan[gguf_name] = (hf_names, (count, *shapes.pop()))
    return plan


def _add_tensor_info(writer, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    import gguf

    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
    # tensor_dtype only has to be "not uint8" when raw_dtype is given: the shape is then taken as is.
    writer.add_tensor_info(name, shape, np.dtype(np.float32), nbytes,
                           raw_dtype=gguf.GGMLQuantizationType[_TORCH_TO_GGML[dtype]])


def _as_numpy(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.contiguous()
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: write its bits
        return tensor.view(torch.int16).numpy()
    return tensor.numpy()


def _add_value(writer, key: str, value) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        raise TypeError(f"cannot store {key}={value!r} in GGUF metadata")


# ================================================================ tokenizer

def _add_tokenizer(writer, checkpoint: Checkpoint) -> None:
    """Store a byte-level BPE tokenizer in the ``tokenizer.ggml.*`` (gpt2) fields."""
    tok = checkpoint.tokenizer_spec
    if tok is None and checkpoint.tokenizer_dir is not None:
        tok = _spec_from_tokenizer_dir(Path(checkpoint.tokenizer_dir), checkpoint.config)
    if tok is None:  # no vocabulary, but the special ids are known (llama.cpp's SpecialVocab does so too)
        for key, field in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                           ("pad_token_id", "padding_token_id")):
            value = checkpoint.config.get(key)
            value = value[0] if isinstance(value, list) and value else value
            if isinstance(value, int):
                writer.add_uint32(f"tokenizer.ggml.{field}", value)
        return
    vocab_size = int(checkpoint.config.get("vocab_size") or 0)
    tokens, types = list(tok["tokens"]), list(tok["token_types"])
    for i in range(len(tokens), vocab_size):  # llama.cpp wants one token per embedding row
        tokens.append(f"[PAD{i}]")
        types.append(_UNUSED)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", tok.get("pre") or "default")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", types)
    writer.add_array("tokenizer.ggml.merges", list(tok["merges"]))
    for key, field in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                       ("padding_token_id", "padding_token_id")):
        if tok.get(key) is not None:
            writer.add_uint32(f"tokenizer.ggml.{field}", int(tok[key]))
    if tok.get("add_bos_token") is not None:
        writer.add_bool("tokenizer.ggml.add_bos_token", bool(tok["add_bos_token"]))
    if tok.get("chat_template"):
        writer.add_string("tokenizer.chat_template", tok["chat_template"])
    if tok.get("pre_tokenizer"):
        writer.add_string("vramshard.tokenizer.pre_tokenizer", json.dumps(tok["pre_tokenizer"]))


def _spec_from_tokenizer_dir(directory: Path, config: dict) -> dict | None:
    """The gpt2 tokenizer fields of an HF tokenizer.json, or None (logged) if it is another kind."""
    try:
        data = json.loads((directory / "tokenizer.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        log.warning("not storing the tokenizer: cannot read %s: %s", directory / "tokenizer.json", exc)
        return None
    model = data.get("model") or {}
    if model.get("type") != "BPE" or "ByteLevel" not in json.dumps(data.get("pre_tokenizer")):
        log.warning("not storing the tokenizer in GGUF: only byte-level BPE tokenizers are supported "
                    "(this one is %s)", model.get("type"))
        return None
    by_id = {int(i): t for t, i in model.get("vocab", {}).items()}
    types = {i: _NORMAL for i in by_id}
    for added in data.get("added_tokens") or []:
        by_id[int(added["id"])] = added["content"]
        types[int(added["id"])] = _CONTROL if added.get("special") else _USER_DEFINED
    count = max(by_id) + 1 if by_id else 0
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(count)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    tok_config = _read_json(directory / "tokenizer_config.json")
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}]: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text()
    ids = {t: i for i, t in enumerate(tokens)}

    def token_id(config_key: str, tok_key: str):
        value = config.get(config_key)
        if isinstance(value, list):
            value = value[0] if value else None
        if value is None:
            special = tok_config.get(tok_key)
            special = special.get("content") if isinstance(special, dict) else special
            value = ids.get(special)
        return value

    return {
        "model": "gpt2", "tokens": tokens, "merges": merges,
        "token_types": [types.get(i, _UNUSED) for i in range(count)],
        "bos_token_id": token_id("bos_token_id", "bos_token"),
        "eos_token_id": token_id("eos_token_id", "eos_token"),
        "padding_token_id": token_id("pad_token_id", "pad_token"),
        "chat_template": template,
        "pre": _pre_name(data.get("pre_tokenizer")),
        "add_bos_token": bool(tok_config.get("add_bos_token", False)),
        "pre_tokenizer": data.get("pre_tokenizer"),
    }


def _pre_name(pre_tokenizer) -> str:
    """llama.cpp's name (tokenizer.ggml.pre) for an HF byte-level pre-tokenizer, by its split regex."""
    text = json.dumps(pre_tokenizer)
    if '"Split"' in text:
        if r"\\p{N}{1,3}" in text:
            return "llama-bpe"  # Llama 3: numbers split in groups of up to three digits
        if r"\\p{N}|" in text:
            return "qwen2"  # Qwen2/2.5/3: one digit per piece
        return "default"
    return "gpt-2" if '"use_regex": true' in text else "default"


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


# ================================================================ writing an HF directory

_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
              torch.uint8: "U8", torch.bool: "BOOL"}


def write_hf_dir(out_dir: str | Path, checkpoint: Checkpoint, progress: Progress | None = None) -> None:
    """Write config.json + model.safetensors (+ tokenizer files) of ``checkpoint`` into ``out_dir``.

    A sharded model already in ``out_dir`` (index + shards) is removed, as it would shadow the new one.

    The safetensors file is written one tensor at a time (the format is a JSON header and raw
    little-endian bytes), then moved into place. A tokenizer embedded in a GGUF is written as a
    byte-level BPE tokenizer.json.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    infos = dict(checkpoint.tensors.items())
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, info in infos.items():
        if info.dtype not in _ST_DTYPES:
            raise ModelLoadError(f"cannot write tensor {name!r} of dtype {info.dtype} to safetensors")
        nbytes = int(np.prod(info.shape, dtype=np.int64)) * torch.empty((), dtype=info.dtype).element_size()
        header[name] = {"dtype": _ST_DTYPES[info.dtype], "shape": list(info.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    target = out_dir / "model.safetensors"
    tmp = out_dir / f".model.safetensors.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(len(header_bytes).to_bytes(8, "little"))
            f.write(header_bytes)
            for done, name in enumerate(infos, 1):
                tensor = checkpoint.tensors.load(name).contiguous()
                f.write(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
                if progress:
                    progress(done, len(infos))
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    # Shards of a model written here before would be read instead of (or with) the new file.
    for stale in [*out_dir.glob("model-*-of-*.safetensors"), out_dir / "model.safetensors.index.json"]:
        if stale.is_file():
            log.warning("%s: removing %s of the model written there before", out_dir, stale.name)
            stale.unlink()
    _write_text(out_dir / "config.json", json.dumps(checkpoint.config, indent=2, sort_keys=True) + "\n")
    if checkpoint.tokenizer_dir is not None:
        for file in _TOKENIZER_FILES:
            source = Path(checkpoint.tokenizer_dir) / file
            if source.is_file() and source.resolve() != (out_dir / file).resolve():
                shutil.copyfile(source, out_dir / file)
    elif checkpoint.tokenizer_spec is not None:
        tokenizer_json, tokenizer_config = _hf_tokenizer_files(checkpoint.tokenizer_spec)
        _write_text(out_dir / "tokenizer.json", json.dumps(tokenizer_json, ensure_ascii=False))
        _write_text(out_dir / "tokenizer_config.json", json.dumps(tokenizer_config, indent=2))


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _hf_tokenizer_files(tok: dict) -> tuple[dict, dict]:
    """tokenizer.json and tokenizer_config.json for a gpt2 tokenizer spec."""
    tokens, types = tok["tokens"], tok["token_types"]
    added, vocab = [], {}
    for i, (token, kind) in enumerate(zip(tokens, types)):
        vocab[token] = i  # HF lists added tokens in the model vocabulary as well
        if kind in (_CONTROL, _USER_DEFINED):
            added.append({"id": i, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": kind != _CONTROL, "special": kind == _CONTROL})
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tokenizer_json = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None, "pre_tokenizer": tok.get("pre_tokenizer") or byte_level,
        "post_processor": None, "decoder": {**byte_level, "type": "ByteLevel"},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": list(tok["merges"])},
    }
    tokenizer_config: dict = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for key, id_key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                        ("pad_token", "padding_token_id")):
        if tok.get(id_key) is not None and int(tok[id_key]) < len(tokens):
            tokenizer_config[key] = tokens[int(tok[id_key])]
    if tok.get("chat_template"):
        tokenizer_config["chat_template"] = tok["chat_template"]
    tokenizer_config["add_bos_token"] = bool(tok.get("add_bos_token", False))
    return tokenizer_json, tokenizer_config


__all__ = ["read_gguf", "write_gguf", "write_hf_dir"]
