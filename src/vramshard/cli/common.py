"""What ``run``, ``chat`` and ``demo`` share: their flags, loading with progress, the streaming loop."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

from rich.console import Console

from ..errors import InvalidInputError

_ESCAPES = {"\\n": "\n", "\\t": "\t", "\\r": "\r"}


def add_sampling_args(parser: argparse.ArgumentParser, max_new_tokens: int = 128,
                      temperature: float = 0.0) -> None:
    """-n, --temp, --top-k, --top-p, --min-p, --seed, the penalties, --stop."""
    group = parser.add_argument_group("sampling")
    group.add_argument("-n", "--max-new-tokens", type=int, default=max_new_tokens, metavar="N",
                       help=f"most tokens to generate (default {max_new_tokens})")
    group.add_argument("--temp", "--temperature", dest="temperature", type=float, default=temperature,
                       help=f"sampling temperature; 0 is greedy (default {temperature})")
    group.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (default 1.0: off)")
    group.add_argument("--min-p", type=float, default=0.0,
                       help="drop tokens less likely than this fraction of the likeliest one (llama.cpp's and vLLM's "
                            "min-p; default 0: off)")
    group.add_argument("--seed", type=int, default=None, help="random seed for reproducible sampling")
    group.add_argument("--repeat-penalty", "--repetition-penalty", dest="repetition_penalty", type=float, default=1.0,
                       help="divide the logits of tokens already in the prompt or answer by this (llama.cpp's "
                            "--repeat-penalty; default 1.0: off)")
    group.add_argument("--repeat-last-n", type=int, default=-1, metavar="N",
                       help="the repeat penalty looks at the last N tokens of the prompt and answer (llama.cpp's "
                            "--repeat-last-n; 0: off; default -1: all of them, as transformers and vLLM)")
    group.add_argument("--presence-penalty", type=float, default=0.0,
                       help="subtract this from the logits of tokens already generated (-2..2, default 0)")
    group.add_argument("--frequency-penalty", type=float, default=0.0,
                       help="subtract this per occurrence from the logits of tokens already generated (-2..2)")
    group.add_argument("--stop", action="append", default=[], metavar="STR",
                       help="stop before this text (repeat for several; \\n and \\t are understood)")


def add_threads_arg(parser) -> None:
    """-t/--threads (llama.cpp's -t): the most CPU threads the engine computes on."""
    parser.add_argument("-t", "--threads", type=int, default=None, metavar="N",
                        help="the most CPU threads to compute on, e.g. to leave cores to a game beside it; the "
                             "planner prices the CPU's work at that many (default: all cores)")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """--vram, --device, --placement, --dtype, --threads, --cuda-graphs, --compile."""
    group = parser.add_argument_group("placement")
    group.add_argument("--vram", default="auto", metavar="SIZE",
                       help="VRAM budget, e.g. 4GiB or 2048MiB, auto: the free VRAM less a safety margin "
                            "(no GPU on a machine without CUDA), or none: no limit (default: auto)")
    group.add_argument("--device", choices=("cpu", "cuda"), default=None,
                       help="where to run (default: cuda when available)")
    group.add_argument("--placement", default=None, metavar="NAME",
                       help="force a placement instead of the planned one (see `vramshard plan`)")
    group.add_argument("--dtype", default=None, choices=("float32", "float16", "bfloat16"),
                       help="weights and compute dtype (default: the checkpoint's)")
    add_threads_arg(group)
    group.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                       help="replay decode steps over VRAM-resident sub-layers from CUDA graphs "
                            "(default: on; --no-cuda-graphs runs every step eagerly)")
    group.add_argument("--compile", action="store_true",
                       help="fuse the element-wise work of those graphs with torch.compile (inductor): faster "
                            "decode, after some seconds of compiling at the first decode steps")


def engine_options(args: argparse.Namespace) -> dict:
    """The ``Engine.load`` options of --threads, --cuda-graphs and --compile."""
    return {"threads": args.threads, "decode_graphs": args.cuda_graphs,
            "decode_compile": "inductor" if args.compile else None}


def stderr_console() -> Console:
    """Rich console for status and statistics, so stdout carries only the generated text."""
    return Console(stderr=True, highlight=False)


def load_engine(model: str, args: argparse.Namespace, console: Console):
    """``Engine.load`` with the command's placement flags and, on a terminal, a progress bar."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from ..engine import Engine

    def load(report=None):
        return Engine.load(model, vram=args.vram, device=args.device, dtype=args.dtype,
                           placement=args.placement, progress=report, **engine_options(args))

    if not console.is_terminal:  # rich would still write a blank line into a pipe or log file
        return load()
    with Progress(TextColumn("loading {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeRemainingColumn(), console=console, transient=True) as progress:
        task = progress.add_task(str(model), total=None)
        return load(lambda done, total: progress.update(task, completed=done, total=total))


def parse_ids(text: str) -> list[int]:
    """``"1, 2,3"`` → ``[1, 2, 3]``."""
    try:
        ids = [int(part) for part in text.replace(" ", ",").split(",") if part]
    except ValueError:
        raise InvalidInputError(f"--ids wants comma-separated integers such as 1,2,3, got {text!r}") from None
    if not ids:
        raise InvalidInputError("--ids is empty; give at least one token id, e.g. --ids 1,2,3")
    return ids


def unescape(text: str) -> str:
    """Turn the two-character sequences ``\\n``, ``\\t``, ``\\r`` typed on a command line into characters."""
    for escaped, char in _ESCAPES.items():
        text = text.replace(escaped, char)
    return text


def write_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


@dataclass
class StreamResult:
    """What one streamed generation produced and how long it took."""

    prompt_tokens: int
    ids: list[int] = field(default_factory=list)
    text: str = ""
    prompt_s: float = 0.0  # from the call until the first new token (prefill)
    generate_s: float = 0.0  # from the first new token to the last
    stopped_at: str | None = None  # the stop string that ended it, if any
    interrupted: bool = False
    cached_tokens: int = 0  # of the prompt, tokens taken from the prefix cache (not computed)

    @property
    def total_s(self) -> float:
        return self.prompt_s + self.generate_s

    @property
    def prompt_tok_s(self) -> float:
        return self.prompt_tokens / self.prompt_s if self.prompt_s else 0.0

    @property
    def generate_tok_s(self) -> float:
        # The first new token comes out of the prefill step, so it is not counted here.
        return (len(self.ids) - 1) / self.generate_s if len(self.ids) > 1 and self.generate_s else 0.0


def stream(engine, prompt_ids: list[int], args: argparse.Namespace, write: Callable[[str], None] = write_stdout,
           *, as_text: bool = True, max_new_tokens: int | None = None, interruptible: bool = False,
           scheduler=None) -> StreamResult:
    """Generate from ``prompt_ids`` with the sampling flags in ``args``, writing output as it comes.

    as_text: write decoded text (cut before any ``--stop`` string, which is held back until it is
    certain), else write the token ids. interruptible: Ctrl-C ends this answer and returns what
    was made so far instead of propagating. scheduler: the engine's scheduler to run in, kept
    between calls (a chat: its prefix cache holds the conversation read so far).
    """
    from ..loading.tokenizer import StopStringFilter, StreamDecoder

    stops = [unescape(s) for s in args.stop]
    decoder = StreamDecoder(engine.tokenizer) if as_text else None
    stop_filter = StopStringFilter(stops)
    result = StreamResult(prompt_tokens=len(prompt_ids))
    tokens = engine.stream(prompt_ids, args.max_new_tokens if max_new_tokens is None else max_new_tokens,
                           temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                           seed=args.seed,
                           repetition_penalty=args.repetition_penalty, repeat_last_n=args.repeat_last_n,
                           presence_penalty=args.presence_penalty,
                           frequency_penalty=args.frequency_penalty,
                           **({} if scheduler is None else {"scheduler": scheduler}))
    start = time.perf_counter()
    first = None
    try:
        for token in tokens:
            if first is None:
                first = time.perf_counter()
            result.ids.append(token)
            if decoder is None:
                write(f"{',' if len(result.ids) > 1 else ''}{token}")
                continue
            shown = stop_filter.feed(decoder.feed(token))
            result.text += shown
            write(shown)
            if stop_filter.stopped:
                result.stopped_at = stop_filter.hit
                break
        else:
            if decoder is not None:
                shown = stop_filter.feed(decoder.flush()) + stop_filter.flush()
                result.text += shown
                write(shown)
    except KeyboardInterrupt:
        if not interruptible:
            raise
        result.interrupted = True
    finally:
        tokens.close()
    end = time.perf_counter()
    result.prompt_s = (first or end) - start
    result.generate_s = end - first if first is not None else 0.0
    result.cached_tokens = engine.last_stats.extra.get("cached_prompt_tokens", 0) if engine.last_stats else 0
    return result


def print_stats(console: Console, result: StreamResult) -> None:
    """One dim line: tokens, prompt and generation speed, total time."""
    end = " (interrupted)" if result.interrupted else f" (stopped at {result.stopped_at!r})" if result.stopped_at else ""
    cached = f" ({result.cached_tokens} cached)" if result.cached_tokens else ""
    console.print(
        f"[dim]prompt {result.prompt_tokens} tokens{cached}, {result.prompt_tok_s:.1f} tok/s · "
        f"generated {len(result.ids)} tokens, {result.generate_tok_s:.1f} tok/s · "
        f"total {result.total_s:.2f} s{end}[/dim]"
    )
