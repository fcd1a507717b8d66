"""The first prompt chunk after a new plan: its split FFNs' CPU parts packed in the step (as before
session 33) against packed by the background thread while the step computes them plain, and the
chunk once its parts are packed (the steady state), in one process.

A named shape with random weights, cut to a few layers, every FFN split between the CPU and a
GPU (simulated without one: the GPU's share is computed on the CPU too, so only the differences
between the rows matter); parts prepacked for oneDNN (``VRAMSHARD_CPU_PACKED=on``). Each repetition
drops the packed parts first, as a re-plan that splits FFNs anew does.

    PYTHONPATH=src python -m benchmarks.first_prompt --shape llama3-8b --layers 2 --rows 128 --json first_prompt.json
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

from .common import hardware, now, write_json

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
    parser.add_argument("--rows", type=int, default=128, help="prompt chunk (more than cpu_swiglu.MAX_ROWS)")
    parser.add_argument("--cpu-pieces", type=int, default=8, help="of each FFN's pieces, on the CPU")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    import torch

    from vramshard import Engine
    from vramshard.models import build_model
    from vramshard.plan.placement import CPU, GPU_STREAMED, Placement, split_ffn
    from vramshard.runtime import cpu_packed
    from vramshard.shapes import random_weights, shape_config

    cpu_packed.MODE = "on"  # (read when the executor makes its PackedParts)
    config = shape_config(args.shape)
    config["num_hidden_layers"] = args.layers
    model = build_model(config, torch.bfloat16)
    placement = Placement("split", tuple(
        (s.name, split_ffn(args.cpu_pieces) if s.kind == "ffn" else CPU if s.kind == "embed" else GPU_STREAMED)
        for s in model))
    engine = Engine.from_weights(model, random_weights(model), None, name=args.shape, placement=placement,
                                 simulate_gpu=True, max_context=args.rows)
    packed = engine.executor.packed_parts
    with torch.inference_mode():
        chunk_seconds(engine, args.rows)  # (first-call allocations, off the record)
        results: dict[str, list[float]] = {"first, packed in the step": [], "first, packed in the background": [],
                                           "after packing (steady)": []}
        for _ in range(args.reps):
            for background, label in ((False, "first, packed in the step"), (True, "first, packed in the background")):
                packed.keep(set())  # a new plan's parts: none packed yet
                packed.background = background
                results[label].append(chunk_seconds(engine, args.rows))
                packed.wait()
                results["after packing (steady)"].append(chunk_seconds(engine, args.rows))
    medians = {label: statistics.median(values) for label, values in results.items()}
    for label, value in medians.items():
        log.info("%-34s %.3f s (median of %d: %s)", label, value, len(results[label]),
                 ", ".join(f"{v:.3f}" for v in results[label]))
    log.info("packed parts: %.2f GiB; background packing took %.2f s in all", packed.nbytes / 2**30,
             packed.background_s)
    out = {"date": now(), "hardware": hardware(), "args": vars(args), "seconds": results, "median_s": medians,
           "packed_gib": packed.nbytes / 2**30}
    if args.json:
        write_json(args.json, out)


if __name__ == "__main__":
    main()
