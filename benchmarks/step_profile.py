"""Where one decode step spends its time: torch.profiler tables for a placement.

    PYTHONPATH=src python -m benchmarks.step_profile --shape nemo-8b --layers 8 --placements gpu,static
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from vramshard.layers.step import Step
from vramshard.models import build_model
from vramshard.plan.memory import sublayer_triples
from vramshard.plan.placement import named_placement
from vramshard.runtime.executor import Executor
from vramshard.runtime.host_weights import pack_model
from vramshard.shapes import random_weights, shape_config

from .common import sync


def dispatch_us(device: str, n: int = 2000) -> float:
    x = torch.zeros(16, device=device)
    for _ in range(100):
        x.add_(1)
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        x.add_(1)
    sync()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="nemo-8b")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--placements", default="gpu,static")
    parser.add_argument("--rows", type=int, default=25)
    args = parser.parse_args()
    print(f"dispatch of one tiny op: cuda {dispatch_us('cuda'):.1f} us, cpu {dispatch_us('cpu'):.1f} us")
    config = shape_config(args.shape)
    config["num_hidden_layers"] = args.layers
    model = build_model(config)
    host = pack_model(list(model), random_weights(model), pin=True)
    for spec in args.placements.split(","):
        placement = named_placement(spec, sublayer_triples(model), args.layers)
        executor = Executor(model, host, placement, max_tokens=64, max_context=args.ctx + 64)
        kv = executor.new_kv_cache(1, args.ctx + 40)
        token = torch.tensor([3])
        for i in range(5):
            executor.forward(token, Step.single(args.ctx + i, 1, kv_lookup=kv))
        sync()
        t0 = time.perf_counter()
        for i in range(10):
            executor.forward(token, Step.single(args.ctx + 5 + i, 1, kv_lookup=kv))
        sync()
        step_ms = (time.perf_counter() - t0) / 10 * 1e3
        print(f"\n=== {spec}: {step_ms:.2f} ms per decode step, {len(model)} sub-layers ===")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(3):
                executor.forward(token, Step.single(args.ctx + 20 + i, 1, kv_lookup=kv))
            sync()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12))
        del executor, kv


if __name__ == "__main__":
    main()
