"""Prompt chunks through split FFNs on the CPU: their parts from oneDNN-prepacked weights against the
plain ones (with row-major down copies), part by part, with the time packing them takes; and a whole
chunk, the first after a new plan (its down copies made in the step) and the next, in one process.

Since session 33 prompt chunks compute their parts plain (``runtime/cpu_packed.py``); this measures
why. A named shape with random weights, cut to a few layers, every FFN split between the CPU and a
GPU (simulated without one: the GPU's share is computed on the CPU too, so only the part timings
compare like with like).

    PYTHONPATH=src python -m benchmarks.first_prompt --shape llama3-8b --layers 2 --rows 128 --json first_prompt.json
"""

from __future__ import annotations

import argparse
import logging
import time

from .common import hardware, median_seconds, now, write_json

log = logging.getLogger("first_prompt")


def chunk_seconds(engine, rows: int) -> float:
    """Wall seconds of one prompt chunk of ``rows`` tokens through the engine's executor."""
    import torch

    from vramshard.layers.step import Step

    kv = engine.executor.new_kv_cache(slots=1, max_ctx=rows)
    tokens = torch.arange(rows) % engine.args.vocab_size
    began = time.perf_counter()
    engine.executor.forward(tokens, Step.single(0, rows, kv_lookup=kv))
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rows", type=int, default=128, help="prompt chunk (more than DECODE_ROWS)")
    parser.add_argument("--cpu-pieces", type=int, default=8, help="of each FFN's pieces, on the CPU")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    import torch

    from vramshard import Engine
    from vramshard.layers.mlp import DenseFFN
    from vramshard.models import build_model
    from vramshard.plan.placement import CPU, GPU_STREAMED, Placement, split_ffn
    from vramshard.runtime.cpu_packed import PackedPart
    from vramshard.shapes import random_weights, shape_config

    config = shape_config(args.shape)
    config["num_hidden_layers"] = args.layers
    model = build_model(config, torch.bfloat16)
    placement = Placement("split", tuple(
        (s.name, split_ffn(args.cpu_pieces) if s.kind == "ffn" else CPU if s.kind == "embed" else GPU_STREAMED)
        for s in model))
    engine = Engine.from_weights(model, random_weights(model), None, name=args.shape, placement=placement,
                                 simulate_gpu=True, max_context=args.rows)
    executor = engine.executor
    parts = {"plain (down copied)": 0.0, "packed": 0.0, "packing": 0.0, "down copies": 0.0}
    with torch.inference_mode():
        chunk_seconds(engine, args.rows)  # (first-call allocations, off the record)
        executor._down_copies.keep(set())  # a new plan's parts: no copies yet
        first = chunk_seconds(engine, args.rows)
        steady = median_seconds(lambda: chunk_seconds(engine, args.rows), args.reps)
        for sublayer in (s for s in model if isinstance(s, DenseFFN)):
            views = executor._cpu_part(sublayer, args.cpu_pieces)
            began = time.perf_counter()
            plain = {**views, "down_proj": views["down_proj"].contiguous()}
            parts["down copies"] += time.perf_counter() - began
            began = time.perf_counter()
            packed = PackedPart(views, args.rows)
            parts["packing"] += time.perf_counter() - began
            h = torch.randn(args.rows, sublayer.hidden).to(model.dtype)
            parts["plain (down copied)"] += median_seconds(lambda: sublayer.contribution(plain, h), args.reps)
            parts["packed"] += median_seconds(lambda: packed.contribution(h), args.reps)
    log.info("a %d-row chunk: %.3f s the first after a new plan (down copies made in it), %.3f s after "
             "(median of %d)", args.rows, first, steady, args.reps)
    for label, value in parts.items():
        log.info("the CPU parts, %-20s %.3f s (summed over %d FFNs)", label, value, args.layers)
    out = {"date": now(), "hardware": hardware(), "args": vars(args), "first_chunk_s": first, "chunk_s": steady,
           "parts_s": parts}
    if args.json:
        write_json(args.json, out)


if __name__ == "__main__":
    main()
