"""Reading a Hugging Face model directory: config.json and (sharded) safetensors.

Only safetensors are read: ``*.bin``/``*.pt`` pickles are refused, never unpickled.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import ModelLoadError
from .checkpoint import Checkpoint, TensorInfo, TensorSource

log = logging.getLogger(__name__)

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


def read_hf_dir(path: Path) -> Checkpoint:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{str(path)!r} has no config.json; is it a Hugging Face model directory?")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{config_path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{config_path} must hold a JSON object")

    files = _safetensors_files(path)
    infos: dict[str, TensorInfo] = {}
    file_of: dict[str, Path] = {}
    for file in files:
        for name, info in _read_header(file).items():
            infos[name] = info
            file_of[name] = file

    handles: dict[Path, object] = {}

    def load(name: str) -> torch.Tensor:
        file = file_of[name]
        if file not in handles:
            handles[file] = safe_open(str(file), framework="pt", device="cpu")
        try:
            return handles[file].get_tensor(name)
        except Exception as exc:  # safetensors raises its own error types
            raise ModelLoadError(f"cannot read tensor {name!r} from {file}: {exc}") from None

    has_tokenizer = (path / "tokenizer.json").is_file()
    return Checkpoint(path, config, TensorSource(infos, load), path if has_tokenizer else None)


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {exc}") from None
        files = sorted({path / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} lists shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        hint = (
            f" (found {', '.join(pickles)}: pickle checkpoints are never loaded; convert them to "
            "safetensors first)" if pickles else ""
        )
        raise ModelLoadError(f"{str(path)!r} has no *.safetensors weights{hint}")
    return files


def _read_header(file: Path) -> dict[str, TensorInfo]:
    """Parse a safetensors header and check that the file is long enough for its data."""
    size = file.stat().st_size
    try:
        with open(file, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            if size < 8 or header_len <= 0 or 8 + header_len > size:
                raise ValueError("header length is out of range")
            header = json.loads(f.read(header_len))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{file} is not a valid safetensors file (truncated or corrupt: {exc})") from None
    infos = {}
    data_len = size - 8 - header_len
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPES[entry["dtype"]]
            start, end = entry["data_offsets"]
            shape = tuple(int(d) for d in entry["shape"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"{file}: bad header entry for {name!r}: {exc}") from None
        if end > data_len:
            raise ModelLoadError(
                f"{file} is truncated: tensor {name!r} ends at byte {end} of a {data_len}-byte data section"
            )
        infos[name] = TensorInfo(shape, dtype)
    return infos
