"""``vramshard demo``: build the built-in demo model on first use, generate from it, show tok/s."""

from __future__ import annotations

import argparse
import unicodedata

from .common import add_engine_args, add_sampling_args, load_engine, stderr_console, write_stdout
from .run import generate_and_report

DEFAULT_PROMPT = "vramshard runs language models whose weights do not fit in"


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo", help="run the built-in demo model (no download needed)",
        description="Build a small Qwen3 with random weights in the cache directory (first run only), "
                    "then generate from it and report the speed.",
    )
    parser.add_argument("-p", "--prompt", metavar="TEXT", default=DEFAULT_PROMPT,
                        help="the prompt text (default: a sentence about vramshard)")
    # Greedy decoding of random weights repeats one token forever; sampling shows more of the tokenizer.
    add_sampling_args(parser, max_new_tokens=64, temperature=0.8)
    add_engine_args(parser)
    parser.set_defaults(func=main, ids=None, chat=False, system=None)


def main(args: argparse.Namespace) -> int:
    from ..demo_model import DEMO_VERSION, ensure_demo_model

    console = stderr_console()
    with console.status("preparing the demo model") as status:
        path = ensure_demo_model(status=lambda line: status.update(f"{line} (first run only)"))
    args.model = str(path)
    console.print(f"[bold]demo model[/bold] {path} (Qwen3, 4 layers, demo v{DEMO_VERSION})")
    console.print("[yellow]Its weights are random, so the text is gibberish; the speed is real.[/yellow]")
    engine = load_engine(args.model, args, console)
    write_stdout(args.prompt)  # the continuation follows it on the same line
    return generate_and_report(engine, args, console, write=_printable)


def _printable(text: str) -> None:
    """Random weights pick control bytes too; keep them off the terminal (they could be escape codes)."""
    write_stdout("".join(c for c in text if c in "\n\t" or unicodedata.category(c) != "Cc"))
