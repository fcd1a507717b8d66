"""``vramshard run MODEL -p TEXT``: generate from one prompt, streamed as it is made."""

from __future__ import annotations

import argparse
from typing import Callable

from rich.console import Console

from ..errors import InvalidInputError
from . import images
from .common import (add_engine_args, add_sampling_args, load_engine, parse_ids, print_stats, stderr_console,
                     stream, write_stdout)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "run", help="generate text from a prompt, streamed as it is made",
        description="Generate from one prompt and stream the text to stdout; speed goes to stderr.",
    )
    parser.add_argument("model", metavar="MODEL", help="Hugging Face model directory or .gguf file")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("-p", "--prompt", metavar="TEXT", help="the prompt text")
    source.add_argument("--ids", metavar="IDS",
                        help="the prompt as comma-separated token ids (for models without tokenizer files); "
                             "prints token ids")
    parser.add_argument("--chat", action="store_true",
                        help="send the prompt as a user message through the model's chat template")
    parser.add_argument("--system", metavar="TEXT", default=None, help="system message (with --chat)")
    add_sampling_args(parser)
    add_engine_args(parser)
    images.add_args(parser)
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    console = stderr_console()
    engine = load_engine(args.model, args, console)
    if args.image:
        return images.main(engine, args, console)
    return generate_and_report(engine, args, console)


def generate_and_report(engine, args: argparse.Namespace, console: Console,
                        write: Callable[[str], None] = write_stdout) -> int:
    """Encode the prompt of ``args`` (text or ids), stream the answer, print the statistics."""
    if args.ids is not None:
        if args.stop:
            raise InvalidInputError("--stop matches text; it cannot be used with --ids")
        result = stream(engine, parse_ids(args.ids), args, write, as_text=False)
    else:
        result = stream(engine, encode_prompt(engine, args), args, write)
    if not (result.text or "").endswith("\n") or args.ids is not None:
        write("\n")
    print_stats(console, result)
    return 0


def encode_prompt(engine, args: argparse.Namespace) -> list[int]:
    """Token ids of ``-p``, through the chat template with ``--chat``."""
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise InvalidInputError(
            f"{args.model} has no tokenizer files (tokenizer.json), so text cannot be encoded; "
            "give the prompt as token ids with --ids 1,2,3"
        )
    if args.chat:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.prompt})
        return tokenizer.encode_chat(messages)
    if args.system:
        raise InvalidInputError("--system needs --chat")
    return tokenizer.encode(args.prompt)
