"""``vramshard convert SRC DST``: Hugging Face directory ↔ GGUF file (F32/F16/BF16)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ..errors import InvalidInputError, VramshardError

_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "convert",
        help="convert a model between a Hugging Face directory and a GGUF file",
        description="Convert SRC (a Hugging Face model directory or a .gguf file) to DST: a path "
                    "ending in .gguf gets a GGUF file, any other path a Hugging Face directory.",
    )
    parser.add_argument("src", metavar="SRC", help="Hugging Face model directory or .gguf file")
    parser.add_argument("dst", metavar="DST", help="output .gguf file or directory")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                        help="store matrices in this dtype (GGUF output only; default: as in SRC)")
    parser.add_argument("--force", action="store_true", help="overwrite DST if it exists")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from ..loading.checkpoint import open_checkpoint
    from ..loading.gguf_io import write_gguf, write_hf_dir

    src, dst = Path(args.src).expanduser(), Path(args.dst).expanduser()
    to_gguf = dst.suffix.lower() == ".gguf"
    if dst.exists() and not args.force:
        raise InvalidInputError(f"{dst} already exists; pass --force to overwrite it")
    if dst.exists() and src.resolve() == dst.resolve():
        raise InvalidInputError(f"SRC and DST are the same path ({dst})")
    if args.dtype and not to_gguf:
        raise InvalidInputError("--dtype applies to GGUF output only; DST does not end in .gguf")
    if dst.exists() and to_gguf == dst.is_dir():
        kind = "a directory" if dst.is_dir() else "a file"
        raise InvalidInputError(f"{dst} is {kind}; remove it first or choose another DST")
    checkpoint = open_checkpoint(src)
    console = Console(stderr=True)
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("tensors"), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task(f"writing {dst.name}", total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        try:
            if to_gguf:
                write_gguf(dst, checkpoint, _DTYPES[args.dtype] if args.dtype else None, progress=progress)
            else:
                write_hf_dir(dst, checkpoint, progress=progress)
        except OSError as exc:
            raise VramshardError(f"cannot write {dst}: {exc}") from None
    console.print(f"wrote {dst} ({len(checkpoint.tensors)} tensors)")
    return 0
