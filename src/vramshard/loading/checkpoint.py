"""A checkpoint as vramshard sees it: an HF-style config, named tensors, tokenizer files.

Both formats (a Hugging Face directory of safetensors, a GGUF file) are read into a
:class:`Checkpoint`. Tensor names are always Hugging Face names
(``model.layers.0.self_attn.q_proj.weight``), so the model code knows one naming only.
Tensors are read lazily: a 60 GB checkpoint is never read whole just to list it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Mapping

import torch


@dataclass(frozen=True)
class TensorInfo:
    """Shape and dtype of one stored tensor, known without reading its data."""

    shape: tuple[int, ...]
    dtype: torch.dtype


class TensorSource(Mapping[str, TensorInfo]):
    """Lazy, read-only mapping from HF tensor names to :class:`TensorInfo`.

    ``load(name)`` returns the tensor on the CPU (memory-mapped where the format allows).
    """

    def __init__(self, infos: dict[str, TensorInfo], loader: Callable[[str], torch.Tensor]):
        self._infos = infos
        self._loader = loader

    def __getitem__(self, name: str) -> TensorInfo:
        return self._infos[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._infos)

    def __len__(self) -> int:
        return len(self._infos)

    def load(self, name: str) -> torch.Tensor:
        if name not in self._infos:
            raise KeyError(name)
        return self._loader(name)

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor]) -> "TensorSource":
        """A source over tensors already in memory (tests, random-weight models)."""
        tensors = dict(tensors)
        infos = {k: TensorInfo(tuple(v.shape), v.dtype) for k, v in tensors.items()}
        return cls(infos, tensors.__getitem__)


@dataclass
class Checkpoint:
    """What a model file or directory holds, in Hugging Face terms."""

    path: Path
    config: dict  # the contents of config.json (for GGUF: rebuilt from its metadata)
    tensors: TensorSource
    tokenizer_dir: Path | None = None  # directory with tokenizer.json / tokenizer_config.json
    tokenizer_spec: dict | None = field(default=None, repr=False)  # tokenizer embedded in GGUF


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Open a Hugging Face model directory or a ``.gguf`` file."""
    from ..errors import ModelLoadError

    path = Path(path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            from .gguf_io import read_gguf

            return read_gguf(path)
        raise ModelLoadError(
            f"{str(path)!r} is a file but not a .gguf file; give a Hugging Face model "
            "directory (config.json + *.safetensors) or a .gguf file"
        )
    from .safetensors_dir import read_hf_dir

    return read_hf_dir(path)
