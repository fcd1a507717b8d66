"""A dense FFN on the CPU at many rows: fresh tensors against the executor's reused buffers.

    PYTHONPATH=src python -m benchmarks.ffn_buffers --shape llama3-8b --rows 32,64,256 --json out.json

For each row count, times the whole FFN (split layout, as host weights are packed) and a CPU part
of half its pieces, both ways the executor can compute them: :meth:`DenseFFN.contribution` (fresh
tensors, what ``VRAMSHARD_FFN_BUFFERS=off`` runs) and :meth:`DenseFFN.contribution_into` over
:class:`~vramshard.runtime.ffn_buffers.FFNBuffers` (the default above 16 rows). Weights are cycled
over copies that exceed the last-level cache, as the executor reads them from memory, and the
bound printed beside each is the weights' bytes at the CPU read bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import logging
import math

import torch

from vramshard.profile.bench_matmul import cold_bytes
from vramshard.profile.bench_split import split_ffn
from vramshard.runtime.ffn_buffers import FFNBuffers
from vramshard.runtime.host_weights import pack_sublayer
from vramshard.shapes import shape_config

from .common import cpu_projection_arguments, cpu_read_bandwidth, hardware, now, rounded, timed, write_json

log = logging.getLogger("ffn_buffers")
MAX_LAYERS = 8


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cpu_projection_arguments(parser, rows="32,64,256")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = shape_config(args.shape)
    dtype = getattr(torch, args.dtype)
    ffn = split_ffn(config["hidden_size"], config["intermediate_size"], dtype)
    layer_bytes = sum(spec.nbytes for spec in ffn.weights)
    layers = max(2, min(MAX_LAYERS, math.ceil(cold_bytes("cpu") / layer_bytes)))
    weights = []
    for _ in range(layers):
        tensors = {spec.source: (torch.randn(spec.shape) * 0.02).to(dtype) if len(spec.shape) > 1
                   else torch.ones(spec.shape, dtype=dtype) for spec in ffn.weights}
        weights.append(pack_sublayer(ffn, tensors, pin=False, splittable=True).views)
    half = ffn.num_pieces // 2
    parts = {"whole": weights, "half": [ffn.pieces_of(w, 0, half) for w in weights]}
    read_gb_s = cpu_read_bandwidth() / 1e9
    buffers = FFNBuffers(pinned=False)
    result = {"date": now(), "hardware": hardware(), "shape": args.shape, "dtype": args.dtype, "threads": torch.get_num_threads(), "layers": layers,
              "cpu_read_gb_s": read_gb_s, "cells": []}
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            h = torch.randn(rows, config["hidden_size"]).to(dtype)
            for name, views in parts.items():
                turn = [0]

                def next_layer():
                    turn[0] = (turn[0] + 1) % layers
                    return views[turn[0]]

                def fresh():
                    return ffn.contribution(next_layer(), h)

                def reused():
                    w = next_layer()
                    return ffn.contribution_into(w, h, buffers.result(rows, h.shape[-1], dtype),
                                                 buffers.work(ffn.work_elements(w, rows), dtype))

                part_bytes = layer_bytes if name == "whole" else layer_bytes * half / ffn.num_pieces
                cell = {"rows": rows, "part": name, "fresh_ms": timed(fresh, repeat=args.repeats) * 1e3,
                        "buffers_ms": timed(reused, repeat=args.repeats) * 1e3,
                        "read_bound_ms": part_bytes / (read_gb_s * 1e9) * 1e3}
                cell["speedup"] = cell["fresh_ms"] / cell["buffers_ms"]
                log.info("%s", rounded(cell))
                result["cells"].append(cell)
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
