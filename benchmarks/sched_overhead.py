"""The scheduler's host time per decode step at a batch size, on the CPU (no GPU needed).

    python -m benchmarks.sched_overhead [--batches 1,64] [--vocab 131072] [--steps 20] [--profile]

A tiny-llama with a real vocabulary (131072, nemo-8b's) runs ``batch`` sequences of 16-token
prompts through :class:`~vramshard.runtime.scheduler.Scheduler` on the CPU; after their prompts,
``steps`` decode steps are timed. Printed per batch: ms a step, of it inside the forward (the
model and the step's logits read), and the rest (scheduling, sampling, streaming) — the part
that does not shrink with a faster GPU. ``--profile`` adds the top of a cProfile of the decode steps.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from vramshard.engine import Engine
from vramshard.models import build_model
from vramshard.runtime.host_weights import pack_model
from vramshard.runtime.sampler import SamplingParams
from vramshard.shapes import random_weights, shape_config


def measure(engine: Engine, batch: int, steps: int, profile: bool) -> dict:
    scheduler = engine.scheduler(max_seqs=batch, max_context=64, ignore_eos=True)
    for i in range(batch):
        scheduler.add([1 + (i * 7 + j) % 1000 for j in range(16)], SamplingParams(), steps + 8)
    while scheduler.waiting or scheduler._incoming or any(r.in_prefill for r in scheduler.running):
        scheduler.step()
    profiler = cProfile.Profile() if profile else None
    forward = 0.0
    start = time.perf_counter()
    if profiler:
        profiler.enable()
    for _ in range(steps):
        forward += scheduler.step().forward_s
    if profiler:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(15)
    seconds = (time.perf_counter() - start) / steps
    return {"batch": batch, "step_ms": seconds * 1e3, "forward_ms": forward / steps * 1e3,
            "scheduling_ms": (seconds - forward / steps) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--vocab", type=int, default=131072)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    config = shape_config("tiny-llama")
    config["vocab_size"] = args.vocab
    model = build_model(config, torch.float32)
    engine = Engine.from_host(model, pack_model(list(model), random_weights(model), pin=False, splittable=False),
                              device="cpu", max_context=256, kv_tokens=64 * 64)
    for batch in (int(b) for b in args.batches.split(",")):
        row = measure(engine, batch, args.steps, args.profile)
        print(f"batch {row['batch']}: {row['step_ms']:.2f} ms a step, forward {row['forward_ms']:.2f} ms, "
              f"scheduling {row['scheduling_ms']:.2f} ms")


if __name__ == "__main__":
    main()
