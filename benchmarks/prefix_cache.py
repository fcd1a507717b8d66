"""A chat's turns with the prefix cache against without: time to first token per turn.

    PYTHONPATH=src python -m benchmarks.prefix_cache --shape llama3-8b --layers 4 --device cpu      # dev machine
    PYTHONPATH=src python -m benchmarks.prefix_cache --shape llama3-8b --vram 8 --json $OUT/prefix.json  # GPU

A conversation of ``--turns`` turns (random token ids, the same for both ways): each turn's prompt is
the last one, its answer and ``--message`` new tokens. One way keeps one scheduler for the whole
conversation (as ``vramshard chat`` does), so its prefix cache holds what earlier turns read; the
other gives each turn a scheduler of its own (every turn reads its whole history, as before the
cache). Both generate ``--answer`` greedy tokens a turn, and both must give the same tokens. Per turn:
the prompt's length, the tokens taken from the cache, and the time to first token of each way, whose
floor is the prefill of the tokens not cached.

With ``--batch N``, also N prompts added at once that share the first prompt (``--system`` tokens)
and differ after it (``--message`` tokens each), each answered with ``--answer`` tokens: the prompt
tokens computed and the seconds until all have answered, with the prefix cache and without (a
scheduler of N sequences each way). With it, the first prompt reads the shared part and the others
wait until it is written, then take it.
"""

from __future__ import annotations

import argparse
import logging
import time

from vramshard.engine import Engine
from vramshard.profile import load as load_profile
from vramshard.shapes import random_weights, shape_config
from vramshard.models import build_model

from .common import hardware, now, write_json

log = logging.getLogger("prefix_cache")
GiB = 2**30


def first_token_s(engine: Engine, prompt: list[int], answer: int, scheduler=None) -> tuple[float, list[int]]:
    """Seconds to the first new token of ``prompt``, and the answer's tokens."""
    start = time.perf_counter()
    tokens, first = [], None
    for token in engine.stream(prompt, answer, scheduler=scheduler):
        first = first or time.perf_counter()
        tokens.append(token)
    return first - start, tokens


def shared_batch(engine: Engine, prompts: list[list[int]], answer: int, cache: bool) -> dict:
    """``prompts`` added at once to a scheduler of their own, run until all have answered."""
    scheduler = engine.scheduler(max_seqs=len(prompts), prefix_cache=cache)
    start = time.perf_counter()
    requests = [scheduler.add(prompt, max_new_tokens=answer) for prompt in prompts]
    scheduler.run_until_idle()
    seconds = time.perf_counter() - start
    cell = {"prefix_cache": cache, "prompts": len(prompts), "prompt_tokens": sum(map(len, prompts)),
            "computed_prompt_tokens": scheduler.total_prompt_tokens,
            "cached_prompt_tokens": scheduler.total_cached_prompt_tokens, "seconds": seconds,
            "steps": scheduler.total_steps, "same_tokens": True, "outputs": [r.output_ids for r in requests]}
    log.info("%d prompts at once (%d tokens), prefix cache %s: %d prompt tokens computed, %d cached, %.2f s "
             "until all answered", len(prompts), cell["prompt_tokens"], "on" if cache else "off",
             cell["computed_prompt_tokens"], cell["cached_prompt_tokens"], seconds)
    return cell


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--layers", type=int, default=None, help="cut the shape to this many layers")
    parser.add_argument("--vram", type=float, default=None, help="GiB (planned engine); none: no budget")
    parser.add_argument("--device", default=None)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system", type=int, default=256, help="tokens of the first prompt")
    parser.add_argument("--message", type=int, default=64, help="new tokens each later turn adds")
    parser.add_argument("--answer", type=int, default=16)
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=0, help="also this many prompts at once sharing the first")
    parser.add_argument("--profile", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    config = shape_config(args.shape)
    if args.layers:
        config["num_hidden_layers"] = args.layers
    model = build_model(config)
    options = {"profile": load_profile(args.profile, check_fingerprint=False)} if args.profile else {}
    engine = Engine.from_weights(model, random_weights(model), name=args.shape, device=args.device,
                                 vram=f"{args.vram}GiB" if args.vram else None, max_context=args.ctx, **options)
    import torch

    g = torch.Generator().manual_seed(0)
    words = lambda n: torch.randint(10, config["vocab_size"], (n,), generator=g).tolist()  # noqa: E731
    engine.generate([words(32)], 4)  # warm-up: the first calls of each shape choose their kernels
    kept = engine.scheduler(max_seqs=1)
    prompt, cells = words(args.system), []
    for turn in range(args.turns):
        cold_s, cold = first_token_s(engine, prompt, args.answer)
        cached_before = kept.total_cached_prompt_tokens
        warm_s, warm = first_token_s(engine, prompt, args.answer, kept)
        cells.append({"turn": turn + 1, "prompt_tokens": len(prompt),
                      "cached_tokens": kept.total_cached_prompt_tokens - cached_before,
                      "ttft_ms_without": cold_s * 1e3, "ttft_ms_with": warm_s * 1e3, "same_tokens": cold == warm})
        log.info("turn %d: %d prompt tokens, %d cached; TTFT %.1f ms without the cache, %.1f with", turn + 1,
                 len(prompt), cells[-1]["cached_tokens"], cold_s * 1e3, warm_s * 1e3)
        prompt = prompt + warm + words(args.message)
    system = words(args.system)
    batch = [system + words(args.message) for _ in range(args.batch)]
    batch_cells = [shared_batch(engine, batch, args.answer, cache) for cache in (False, True)] if batch else []
    if batch_cells and batch_cells[0].pop("outputs") != batch_cells[1].pop("outputs"):
        log.error("the batch gave different tokens with the prefix cache")
        batch_cells[1]["same_tokens"] = False
    result = {"date": now(), "hardware": hardware(), "args": vars(args), "model_gib": model.nbytes / GiB,
              "device": str(engine.executor.gpu or "cpu"), "cells": cells, "batch": batch_cells}
    if not all(c["same_tokens"] for c in cells):
        log.error("the two ways gave different tokens")
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
