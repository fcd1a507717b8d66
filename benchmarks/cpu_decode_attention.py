"""One new token's attention on the CPU over a paged cache's rows: the C kernel against SDPA, beside the host's
read, in one process run (no GPU needed).

    PYTHONPATH=src python -m benchmarks.cpu_decode_attention [--heads 32,8,128] [--batches 16,64] [--json FILE]

A decode step on the CPU attends one token per layer over its cached keys and values, which
:func:`~vramshard.layers.attention.attend` hands over as views of the pool's rows [L, Hkv, D] by head.
``sdpa`` is :func:`~vramshard.layers.attention.decode_attention` with the kernel switched off
(``VRAMSHARD_CPU_GEMV=off``: SDPA over the query heads grouped as rows of their key/value head);
``kernel`` is :func:`vramshard.layers.cpu_gemv.decode_attention`, which it takes since session 36. Each
timing walks enough copies of the cache (in the engine's kind of host buffer) that every call reads from
memory; the bound is the keys' and values' bytes at the host's read (:func:`benchmarks.common.cpu_read_bandwidth`).

``--batches``: a decode step of that many sequences at ``--batch-context`` positions each, through
:func:`~vramshard.layers.attention.attend` over a paged cache: ``kernel`` each sequence by the C kernel over its own
rows in place (session 63), ``padded`` the sequences gathered into one padded batch for SDPA (the kernel off); the
cache walked over enough layers that every call reads from memory.
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import torch

from vramshard.layers import cpu_gemv
from vramshard.layers.attention import attend, decode_attention
from vramshard.layers.step import Step
from vramshard.profile.bench_matmul import host_copy
from vramshard.runtime.kv_cache import KVCache

from .common import cpu_read_bandwidth, hardware, now, write_json

log = logging.getLogger("cpu_decode_attention")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", default="32,8,128", help="query heads, key/value heads, head size")
    parser.add_argument("--lengths", default="1024,4096,16384")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    parser.add_argument("--batches", default="", help="sequences of a batched decode step, e.g. 16,64 (none: skipped)")
    parser.add_argument("--batch-context", type=int, default=1024, help="positions each sequence of a batch holds")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    heads, kv_heads, dim = (int(x) for x in args.heads.split(","))
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    read = cpu_read_bandwidth()
    q = torch.randn(1, heads, dim).to(dtype)
    cells = []
    before = os.environ.get("VRAMSHARD_CPU_GEMV")
    try:
        for length in (int(x) for x in args.lengths.split(",")):
            nbytes = 2 * length * kv_heads * dim * dtype.itemsize
            copies = max(2, int(1.5e9 // nbytes))
            pools = [(host_copy(torch.randn(length, kv_heads, dim).to(dtype)),
                      host_copy(torch.randn(length, kv_heads, dim).to(dtype))) for _ in range(copies)]
            cell = {"positions": length, "bytes": nbytes, "bound_ms": nbytes / read * 1e3}
            for name, mode in (("sdpa", "off"), ("kernel", "auto")):
                os.environ["VRAMSHARD_CPU_GEMV"] = mode  # (read at each call)
                best = float("inf")
                for _ in range(3):
                    began = time.perf_counter()
                    for k, v in pools:
                        decode_attention(q, k.transpose(0, 1)[None], v.transpose(0, 1)[None], dim ** -0.5)
                    best = min(best, (time.perf_counter() - began) / copies)
                cell[f"{name}_ms"] = best * 1e3
                cell[f"{name}_gb_s"] = nbytes / best / 1e9
            cells.append(cell)
            log.info("%d positions: bound %.3f ms, SDPA %.3f ms (%.1f GB/s), kernel %.3f ms (%.1f GB/s)", length,
                     cell["bound_ms"], cell["sdpa_ms"], cell["sdpa_gb_s"], cell["kernel_ms"], cell["kernel_gb_s"])
            pools = None
        batches = [batch_cell(int(b), args.batch_context, heads, kv_heads, dim, dtype, read)
                   for b in args.batches.split(",") if b]
    finally:
        if before is None:
            os.environ.pop("VRAMSHARD_CPU_GEMV", None)
        else:
            os.environ["VRAMSHARD_CPU_GEMV"] = before
    result = {"date": now(), "hardware": hardware(), "heads": [heads, kv_heads, dim], "dtype": args.dtype,
              "threads": torch.get_num_threads(), "cpu_gemv": cpu_gemv.isa(), "cpu_read_gb_s": read / 1e9,
              "cells": cells, "batches": batches}
    if args.json:
        write_json(args.json, result)


def batch_cell(seqs: int, context: int, heads: int, kv_heads: int, dim: int, dtype, read: float) -> dict:
    """One batched decode step's attention (``seqs`` sequences at ``context`` positions) through ``attend``: the
    kernel sequence by sequence against the padded batch, and the bound (every cached row read once)."""
    nbytes = 2 * seqs * (context + 1) * kv_heads * dim * dtype.itemsize
    layers = max(2, int(1.5e9 // nbytes))
    cache = KVCache(list(range(layers)), slots=seqs, max_ctx=context + 16, kv_heads=kv_heads, head_dim=dim,
                    dtype=dtype, device_of=lambda layer: "cpu")
    cache.fill_random(context)
    q, k, v = torch.randn(seqs, heads, dim).to(dtype), torch.randn(seqs, kv_heads, dim).to(dtype), \
        torch.randn(seqs, kv_heads, dim).to(dtype)
    cell = {"sequences": seqs, "context": context, "bytes": nbytes, "bound_ms": nbytes / read * 1e3}
    for name, mode in (("padded", "off"), ("kernel", "auto")):
        os.environ["VRAMSHARD_CPU_GEMV"] = mode  # (read at each call)
        best = float("inf")
        for _ in range(3):
            began = time.perf_counter()
            for layer in range(layers):
                step = Step(list(range(seqs)), [context] * seqs, [1] * seqs, None, kv_lookup=cache)
                attend(q, k, v, cache(layer), step)
            best = min(best, (time.perf_counter() - began) / layers)
        cell[f"{name}_ms"] = best * 1e3
        cell[f"{name}_gb_s"] = nbytes / best / 1e9
    log.info("%d sequences x %d positions: bound %.2f ms, padded batch %.2f ms (%.1f GB/s), kernel by sequence %.2f ms "
             "(%.1f GB/s)", seqs, context, cell["bound_ms"], cell["padded_ms"], cell["padded_gb_s"], cell["kernel_ms"],
             cell["kernel_gb_s"])
    return cell


if __name__ == "__main__":
    main()
