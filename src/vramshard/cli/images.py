"""``vramshard run MODEL --image FILE [--image FILE2] -p TEXT``: a prompt with images, for vision-language models.

``run`` adds the option with :func:`add_args` and hands over to :func:`main` when images are given.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from ..errors import InvalidInputError
from .common import print_stats, stream, write_stdout


def add_args(parser: argparse.ArgumentParser) -> None:
    """--image FILE (repeatable), --max-pixels N."""
    group = parser.add_argument_group("images (vision-language models)")
    group.add_argument("--image", action="append", default=[], metavar="FILE",
                       help="an image to put before the prompt (repeat for several; PNG, JPEG, WebP, ...)")
    group.add_argument("--max-pixels", type=int, default=None, metavar="N",
                       help="downscale each image to at most N pixels (default: the model's preprocessor setting)")


def main(engine, args: argparse.Namespace, console: Console, write=write_stdout) -> int:
    """Encode the images and ``-p`` as one user message, stream the answer, print the statistics."""
    from .. import vlm
    from ..loading.image import ImageConfig

    if args.ids is not None:
        raise InvalidInputError("--image needs a text prompt (-p TEXT), not --ids")
    overrides = {} if args.max_pixels is None else {"max_pixels": args.max_pixels}
    model = Path(args.model)
    config = ImageConfig.from_dir(model, **overrides) if model.is_dir() else ImageConfig.from_dict(overrides)
    vlm.configure(engine, vlm.vision_setup(engine).options, config)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": [{"type": "image", "image": Path(p)} for p in args.image]
                     + [{"type": "text", "text": args.prompt}]})
    prompt = vlm.chat_prompt(engine, messages)
    result = stream(_PromptEngine(engine, prompt), prompt.ids, args, write)
    if not result.text.endswith("\n"):
        write("\n")
    print_stats(console, result)
    if "vision_s" in engine.last_stats.extra:
        console.print(f"[dim]vision encoder {engine.last_stats.extra['vision_s']:.2f} s for "
                      f"{len(args.image)} image(s)[/dim]")
    return 0


class _PromptEngine:
    """What :func:`~vramshard.cli.common.stream` needs of an engine, streaming one prompt with images."""

    def __init__(self, engine, prompt):
        self.engine, self.prompt, self.tokenizer = engine, prompt, engine.tokenizer

    @property
    def last_stats(self):
        return self.engine.last_stats

    def stream(self, prompt_ids, max_new_tokens, temperature=0.0, top_k=0, top_p=1.0, seed=None, **adjust):
        from .. import vlm

        return vlm.stream_prompt(self.engine, self.prompt, max_new_tokens, temperature, top_k, top_p, seed, **adjust)
