"""Which part of the profile's way of timing a CPU projection makes it read faster than a model?

The twentieth GPU session measured one-token projections through the executor's ``cpu_linear``
path at 54.2 GB/s (bf16) over a walk of 18 model-sized weights, and at 78.8 GB/s timed the way
``vramshard profile`` times its table points (:func:`vramshard.profile.bench_matmul.measure_matmul`):
the 1.45× by which the estimator underprices the CPU inside a step. The profile's way differs from
the walk in three things. This times each step between them in the same process, interleaved
round by round so that the host's drift hits all of them:

- ``walk``: every weight of ``--gib`` read once per pass (a model's step), seconds per weight;
- ``ring_median``: the profile's ring (as many of the walk's weights as
  :func:`~vramshard.profile.bench_matmul.cold_copies` would make, twice the last-level cache or
  512 MiB), called in turn, median call: the ring's size against the walk's;
- ``ring_lower_quartile``: the same calls, the profile's statistic (``time_cpu``'s lower quartile);
- ``profile``: ``measure_matmul`` itself (fresh clones of one random weight, its own repeats).

    PYTHONPATH=src python3 -m benchmarks.cpu_read_method --json $OUT/cpu_read_method.json

Runs without a GPU. Prints GB/s per method and dtype (median over rounds) and each step's ratio.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import torch

from vramshard.layers.cpu_linear import cpu_linear, settle
from vramshard.profile.bench_matmul import cold_bytes, measure_matmul
from vramshard.profile.progress import ProgressSink
from vramshard.profile.spec import BenchmarkSpec

log = logging.getLogger("cpu_read_method")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
METHODS = ("walk", "ring_median", "ring_lower_quartile", "profile")


def ring_samples(x: torch.Tensor, ring: list[torch.Tensor], calls: int) -> list[float]:
    """Seconds of each of ``calls`` projections over ``ring`` in turn."""
    samples = []
    for i in range(calls):
        start = time.perf_counter()
        cpu_linear(x, ring[i % len(ring)])
        samples.append(time.perf_counter() - start)
    return samples


def one_round(name: str, x: torch.Tensor, walk: list[torch.Tensor], ring: list[torch.Tensor], calls: int) -> dict:
    """Seconds per projection by each method, once."""
    n, k = walk[0].shape
    start = time.perf_counter()
    for w in walk:
        cpu_linear(x, w)
    out = {"walk": (time.perf_counter() - start) / len(walk)}
    samples = sorted(ring_samples(x, ring, calls))
    out["ring_median"] = statistics.median(samples)
    out["ring_lower_quartile"] = samples[(len(samples) - 1) // 4]  # as profile.timing.time_cpu
    spec = BenchmarkSpec()
    table = measure_matmul("cpu", name, [(k, n)], [1], budget_s=spec.point_budget_s, cap_s=spec.point_cap_s,
                           progress=ProgressSink(), label="profile", weight=1.0)
    out["profile"] = table["seconds"][0][0]
    return out


def measure(name: str, n: int, k: int, gib: float, rounds: int, calls: int) -> dict:
    dtype = DTYPES[name]
    nbytes = n * k * dtype.itemsize
    count = max(2, int(gib * 2**30 // nbytes))
    walk = [torch.empty(n, k, dtype=dtype).uniform_(-0.03, 0.03) for _ in range(count)]  # [N, K] each
    ring = walk[:min(count, max(1, -(-cold_bytes("cpu") // nbytes)))]
    x = torch.randn(1, k, dtype=dtype)  # [1, K]: one token
    settle(lambda: cpu_linear(x, walk[0]))
    for w in walk:  # first touch
        cpu_linear(x, w)
    per_round = [one_round(name, x, walk, ring, calls) for _ in range(rounds)]
    gb_s = {m: nbytes / statistics.median(r[m] for r in per_round) / 1e9 for m in METHODS}
    row = {"weights": count, "walk_bytes": count * nbytes, "ring_weights": len(ring), "gb_s": gb_s,
           "rounds_s": per_round,
           "ring_size_effect": gb_s["ring_median"] / gb_s["walk"],
           "statistic_effect": gb_s["ring_lower_quartile"] / gb_s["ring_median"],
           "fresh_clones_effect": gb_s["profile"] / gb_s["ring_lower_quartile"],
           "profile_over_walk": gb_s["profile"] / gb_s["walk"]}
    log.info("%s [%d, %d], walk of %d weights (%.2f GB), ring of %d: %s GB/s; ring size %.2fx, lower quartile "
             "%.2fx, fresh clones %.2fx, profile over walk %.2fx", name, n, k, count, count * nbytes / 1e9, len(ring),
             " / ".join(f"{m} {gb_s[m]:.1f}" for m in METHODS), row["ring_size_effect"], row["statistic_effect"],
             row["fresh_clones_effect"], row["profile_over_walk"])
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=2.0, help="GiB of distinct weights in the walk")
    parser.add_argument("--shape", default="14336,4096", help="N,K of each weight (default a llama3-8b up projection)")
    parser.add_argument("--dtypes", default="bf16,fp16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=30, help="ring calls per round")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    n, k = (int(v) for v in args.shape.split(","))
    result = {"shape": [n, k], "threads": torch.get_num_threads(), "cold_bytes": cold_bytes("cpu"),
              "torch": torch.__version__, "dtypes": {}}
    for name in args.dtypes.split(","):
        if name not in DTYPES:
            raise SystemExit(f"unknown dtype {name!r}: choose from {', '.join(DTYPES)}")
        result["dtypes"][name] = measure(name, n, k, args.gib, args.rounds, args.calls)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
