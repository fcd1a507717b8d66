"""How much the CPU's last-level cache flatters a matmul timing: one-token projections timed
over one weight (hot), over 32 copies (what the profile cycled through before), and over copies
totalling twice the last-level cache (what it cycles through now, as the model reads its weights).

    PYTHONPATH=src python3 -m benchmarks.cold_weights --json $OUT/cold_weights.json

The shapes are a MoE expert's two projections (qwen3-30b-a3b: [2048 -> 1536], [768 -> 2048]) and
a dense FFN's (llama3-8b: [4096 -> 14336], [14336 -> 4096]).
"""

from __future__ import annotations

import argparse
import logging

import torch

from vramshard.profile.bench_matmul import cold_bytes, cold_copies, linear_over
from vramshard.profile.timing import time_cpu

from .common import hardware, now, write_json

SHAPES = ((2048, 1536), (768, 2048), (4096, 14336), (14336, 4096))  # (K, N) of x[1, K] @ W[N, K].T
log = logging.getLogger("cold_weights")


def time_over(weights: list[torch.Tensor], x: torch.Tensor, budget_s: float) -> float:
    return time_cpu(linear_over(x, weights), budget_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="bfloat16,float16")
    parser.add_argument("--budget-s", type=float, default=0.5, help="timing per point")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = []
    with torch.inference_mode():
        for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
            for k, n in SHAPES:
                x = torch.randn(1, k).to(dtype)
                weight = (torch.randn(n, k) * 0.02).to(dtype)
                cold = cold_copies(weight)
                times = {"hot": time_over([weight], x, args.budget_s),
                         "32 copies": time_over(cold[:32], x, args.budget_s),
                         "cold": time_over(cold, x, args.budget_s)}
                gbps = {case: weight.nbytes / s / 1e9 for case, s in times.items()}
                rows.append({"dtype": str(dtype), "k": k, "n": n, "weight_bytes": weight.nbytes, "copies": len(cold),
                             "seconds": times, "gb_s": gbps})
                log.info("%-15s [%5d -> %5d] %6.1f MB: hot %6.1f GB/s, 32 copies %6.1f GB/s, cold (%d copies) %6.1f "
                         "GB/s", dtype, k, n, weight.nbytes / 1e6, gbps["hot"], gbps["32 copies"], len(cold),
                         gbps["cold"])
                del cold
    if args.json:
        write_json(args.json, {"date": now(), "hardware": hardware(), "cold_bytes": cold_bytes("cpu"), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
