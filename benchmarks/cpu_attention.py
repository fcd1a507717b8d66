"""CPU attention as the profile timed it before 2026-12-04 and as a step reads its cache, and the
time of other head layouts against the profiled one (no GPU needed).

    PYTHONPATH=src python -m benchmarks.cpu_attention --json out.json

- ``hot``: one contiguous key/value pair [1, Hkv, L, D], timed over and over (in cache after the
  first call): the profile's attention tables before 2026-12-04;
- ``cold``: the profile's way since (``profile/bench_attention.cycling_cache_reads``): views of a
  paged cache's rows [L, Hkv, D], another copy each call, the copies beyond twice the last-level cache;

both at one new token over (32, 8, 128) heads; then, the ``cold`` way, one and 16 new tokens over
other layouts as a share of (32, 8, 128): what ``Profile.attention_s`` scales an unmeasured layout by.
"""

from __future__ import annotations

import argparse
import logging

import torch

from vramshard.profile.bench_attention import cold_kv_ring, cycling_cache_reads, sdpa_gqa
from vramshard.profile.timing import time_cpu

from .common import hardware, now, write_json

log = logging.getLogger("cpu_attention")
PROFILED = (32, 8, 128)
LAYOUTS = [(32, 4, 128), (28, 4, 128), (16, 8, 128)]


def cold_s(heads: int, kv_heads: int, head_dim: int, n_new: int, keys: int, dtype, budget_s: float) -> float:
    ring = cold_kv_ring(kv_heads * head_dim * keys, dtype)
    q = torch.randn(1, heads, n_new, head_dim, dtype=dtype)
    return time_cpu(cycling_cache_reads(q, ring, kv_heads, keys, head_dim), budget_s)


def hot_s(heads: int, kv_heads: int, head_dim: int, n_new: int, keys: int, dtype, budget_s: float) -> float:
    q = torch.randn(1, heads, n_new, head_dim, dtype=dtype)
    k = torch.randn(1, kv_heads, keys, head_dim, dtype=dtype)
    v = torch.randn_like(k)
    return time_cpu(lambda: sdpa_gqa(q, k, v), budget_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--keys", default="1024,4096,16384")
    parser.add_argument("--budget-s", type=float, default=0.3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dtype = getattr(torch, args.dtype)
    keys = [int(k) for k in args.keys.split(",")]
    result = {"date": now(), "hardware": hardware(), "dtype": args.dtype, "threads": torch.get_num_threads(),
              "hot_vs_cold": [], "layouts": []}
    with torch.inference_mode():
        for n in keys:
            hot, cold = hot_s(*PROFILED, 1, n, dtype, args.budget_s), cold_s(*PROFILED, 1, n, dtype, args.budget_s)
            result["hot_vs_cold"].append({"keys": n, "hot_ms": hot * 1e3, "cold_ms": cold * 1e3, "ratio": cold / hot})
            log.info("%s one token, %d keys: hot %.3f ms, cold %.3f ms (x%.2f)", PROFILED, n, hot * 1e3, cold * 1e3,
                     cold / hot)
        for n in keys:
            for n_new in (1, 16):
                base = cold_s(*PROFILED, n_new, n, dtype, args.budget_s)
                for layout in LAYOUTS:
                    share = cold_s(*layout, n_new, n, dtype, args.budget_s) / base
                    result["layouts"].append({"keys": n, "new_tokens": n_new, "layout": list(layout), "share": share})
                    log.info("%d keys, %2d new tokens: %s takes %.2f of %s", n, n_new, layout, share, PROFILED)
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
