"""CPU projections from plain weights against oneDNN's prepacked weights, at the rows of a step.

    PYTHONPATH=src python -m benchmarks.packed_linear --shape llama3-8b --rows 1,16,64,256 --json out.json

A CPU FFN at 64 rows ran at 2.4× its weights' read time on the H200 host (twelfth GPU session,
``ffn_buffers``: 10.4 ms against 4.3 ms). One suspect is that oneDNN copies a plain (row-major)
weight into its blocked layout on every call. Here, for the shape's gate+up and down projections,
``F.linear`` on the plain weight is timed against ``mkldnn._linear_pointwise`` on a weight
reordered once by ``mkldnn._reorder_linear_weight`` (what inductor's CPU freezing does). Weights
are cycled over copies that exceed the last-level cache, as the executor reads them from memory;
the bound beside each is the weight's bytes at the CPU read bandwidth measured in the same run.
A prepacked weight is a second, opaque copy: only worth it for sub-layers that never stream.
"""

from __future__ import annotations

import argparse
import logging
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from vramshard.profile.bench_matmul import cold_bytes
from vramshard.shapes import shape_config

from .common import cpu_projection_arguments, cpu_read_bandwidth, hardware, now, rounded, timed, write_json

log = logging.getLogger("packed_linear")


def cpu_flags() -> list[str]:
    """The CPU's AMX / AVX-512 BF16 flags (Linux), which decide oneDNN's bf16 kernels."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return []
    return sorted({f for f in flags.split() if f.startswith("amx") or f in ("avx512_bf16", "avx512_fp16")})


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cpu_projection_arguments(parser, rows="1,16,64,256")
    args = parser.parse_args()
    config = shape_config(args.shape)
    dtype = getattr(torch, args.dtype)
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    read_gb_s = cpu_read_bandwidth() / 1e9
    result = {"date": now(), "hardware": hardware(), "cpu_flags": cpu_flags(), "shape": args.shape,
              "dtype": args.dtype, "threads": torch.get_num_threads(), "cpu_read_gb_s": read_gb_s, "cells": []}
    with torch.inference_mode():
        for name, (out_features, in_features) in {"gate_up": (2 * inner, hidden), "down": (hidden, inner)}.items():
            weight_bytes = out_features * in_features * dtype.itemsize
            copies = max(2, min(8, math.ceil(cold_bytes("cpu") / weight_bytes)))
            plain = [(torch.randn(out_features, in_features) * 0.02).to(dtype) for _ in range(copies)]
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, in_features).to(dtype)
                packed = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in plain]
                expected = F.linear(x, plain[0]).float()
                got = torch.ops.mkldnn._linear_pointwise(x, packed[0], None, "none", [], "").float()
                turn = [0]

                def step():
                    turn[0] = (turn[0] + 1) % copies
                    return turn[0]

                cell = {"projection": name, "rows": rows,
                        "plain_ms": timed(lambda: F.linear(x, plain[step()]), repeat=args.repeats) * 1e3,
                        "packed_ms": timed(lambda: torch.ops.mkldnn._linear_pointwise(
                            x, packed[step()], None, "none", [], ""), repeat=args.repeats) * 1e3,
                        "read_bound_ms": weight_bytes / (read_gb_s * 1e9) * 1e3,
                        "max_abs_difference": (expected - got).abs().max().item()}
                cell["speedup"] = cell["plain_ms"] / cell["packed_ms"]
                log.info("%s", rounded(cell))
                result["cells"].append(cell)
                del packed
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
