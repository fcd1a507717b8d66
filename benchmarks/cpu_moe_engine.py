"""A CPU engine of a MoE shape with its routed experts by the C kernel and by the compiled passes, in one
process run, against the host's read bound.

    PYTHONPATH=src python -m benchmarks.cpu_moe_engine --shape qwen3-30b-a3b --layers 4 --json out.json

Engines over the same random weights (``vramshard bench``'s way of building a shape), one with
``VRAMSHARD_CPU_GEMV=off`` (the compiled passes over the host experts, compiled at load) and one with
the kernel (:func:`vramshard.layers.cpu_gemv.routed_experts`) for each of ``--ffn-rows`` (the most rows of
dense FFN work it takes, :data:`~vramshard.layers.cpu_gemv.FFN_ROWS`), each measured as ``vramshard bench``
measures an engine: load, prompt, decode and batched rates. The bound is the host's read bandwidth,
measured in the same run, over the bytes a decode step must read: every weight but the embedding table
and, of each MoE layer's experts, only the routed ones (top-k), plus the KV cache at the decode's
middle context.
"""

from __future__ import annotations

import argparse
import logging
import os

from vramshard.cli.bench import BenchSettings, EngineSpec, bench_engine, load_host
from vramshard.layers import cpu_gemv
from vramshard.layers.moe import MoEFFN

from .common import cpu_read_bandwidth, decode_read_bytes, hardware, now, rounded, write_json

log = logging.getLogger("cpu_moe_engine")

KEPT = ("load_s", "pp_tok_s", "tg_tok_s", "ttft_s", "decode_step_ms_median")


def routed_read_bytes(model, context: int) -> int:
    """:func:`decode_read_bytes` with each MoE layer's experts counted at its routed top-k."""
    unrouted = sum((s.num_experts - s.top_k) * s.expert_bytes for s in model if isinstance(s, MoEFFN))
    return decode_read_bytes(model, context) - unrouted


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--pp", type=int, default=64)
    parser.add_argument("--tg", type=int, default=32)
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--batch-gen", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--ffn-rows", default=str(cpu_gemv.FFN_ROWS),
                        help="comma-separated: the most rows of dense FFN work the kernel takes, one engine each "
                             "(cpu_gemv.FFN_ROWS; 1 as before session 36)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    settings = BenchSettings(pp=args.pp, tg=args.tg, batch_sizes=tuple(int(b) for b in args.batch_sizes.split(",")),
                             batch_gen=args.batch_gen, repeat=args.repeat)
    model, host, name = load_host(None, args.shape, None, args.layers, pin=False)
    before, ffn_rows_before = os.environ.get("VRAMSHARD_CPU_GEMV"), cpu_gemv.FFN_ROWS
    cells = {}
    try:
        kernels = [(f"C kernel, FFNs up to {rows} row(s)" if "," in args.ffn_rows else "C kernel", "auto", int(rows))
                   for rows in args.ffn_rows.split(",")]
        for label, mode, ffn_rows in [("compiled", "off", cpu_gemv.FFN_ROWS)] + kernels:
            os.environ["VRAMSHARD_CPU_GEMV"] = mode  # (read at each call, and by the load's warm-up)
            cpu_gemv.FFN_ROWS = ffn_rows  # (read at each call)
            row = bench_engine(model, host, EngineSpec(label), settings, device="cpu")
            cells[label] = {k: row.get(k) for k in KEPT}
            cells[label].update({f"batch_{b}_tok_s": cell.get("tok_s") for b, cell in (row.get("batched") or {}).items()})
            if "error" in row:
                cells[label]["error"] = row["error"]
            log.info("%s: %s", label, rounded(cells[label]))
    finally:
        cpu_gemv.FFN_ROWS = ffn_rows_before
        if before is None:
            os.environ.pop("VRAMSHARD_CPU_GEMV", None)
        else:
            os.environ["VRAMSHARD_CPU_GEMV"] = before
    read = cpu_read_bandwidth()
    step_bytes = routed_read_bytes(model, args.pp + args.tg // 2)
    result = {"date": now(), "hardware": hardware(), "model": name, "cpu_gemv": cpu_gemv.isa(),
              "cpu_read_gb_s": read / 1e9, "decode_read_mb": step_bytes / 1e6,
              "bound_tok_s": read / step_bytes, "cells": cells}
    for cell in cells.values():
        cell["decode_of_bound"] = cell["tg_tok_s"] / result["bound_tok_s"] if cell.get("tg_tok_s") else None
    log.info("bound %.1f tok/s (%.0f MB a step at %.1f GB/s)", result["bound_tok_s"], step_bytes / 1e6, read / 1e9)
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
