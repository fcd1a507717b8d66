"""A MoE layer's routed experts on the CPU, a few ways, against the host's read bandwidth.

    PYTHONPATH=src python -m benchmarks.cpu_experts --shape qwen3-30b-a3b --json $OUT/cpu_experts.json

The zero-copy kernels read a decode step's experts over PCIe while the CPU computes a share of
them (``Executor(zero_copy_cpu_share=...)``); the share the CPU can take is set by how fast it
computes an expert. On the H200 host the layer's own path took ~0.41 ms an expert at one token
(fourteenth GPU session, ``step_profile``), 4× the read time of its 9.4 MB at ~90 GB/s. This
times, for one token and for ``--rows``, the routed experts of one layer:

- ``layer``: the layer's expert-by-expert CPU path (``MoEFFN.run_experts`` over a source that
  does not stack its experts), all threads;
- ``compiled``: the layer's path over its stacked host experts with the C kernel switched off
  (``VRAMSHARD_CPU_GEMV=off``), the executor's from 2026-12-02 to session 35: every assignment in
  one compiled pass (:mod:`vramshard.layers.host_experts`; the first call, which compiles, timed
  apart as ``compile_s``);
- ``gemv``: the same path as the executor takes it since session 35: at one token, one call of the
  C kernel (:func:`vramshard.layers.cpu_gemv.experts_one_token`); at more rows the compiled pass;
- ``packed``: each expert's gate+up and down reordered once by oneDNN (``mkldnn._reorder_linear_weight``)
  and computed by ``mkldnn._linear_pointwise`` (a second copy of the weights);
- ``threads:K``: K Python threads, each computing its share of the experts with 1/K of the
  intra-op threads (torch releases the GIL in its kernels);

with experts picked at random from all of the layer's (``--experts``, weights cold in cache as the
executor reads them), and the bound: the routed experts' bytes at the CPU read bandwidth measured
in the same run.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time

import torch
import torch.nn.functional as F

from vramshard.layers import cpu_gemv, host_experts
from vramshard.layers.moe import DictExperts, MoEFFN, Routing
from vramshard.models import build_model
from vramshard.shapes import shape_config

from .common import cpu_read_bandwidth, hardware, now, rounded, timed, write_json

log = logging.getLogger("cpu_experts")


def expert_views(gate_up: torch.Tensor, down: torch.Tensor) -> dict[str, torch.Tensor]:
    """The ``experts.{e}.*`` views a host layout offers, over stacked [E, 2F, D] / [E, D, F] tensors."""
    F_ = gate_up.shape[1] // 2
    views = {}
    for e in range(gate_up.shape[0]):
        views[f"experts.{e}.gate_up"] = gate_up[e]
        views[f"experts.{e}.gate"], views[f"experts.{e}.up"] = gate_up[e][:F_], gate_up[e][F_:]
        views[f"experts.{e}.down"] = down[e]
    return views


def run_threads(count: int, work, threads_each: int) -> None:
    """``work(i)`` for i < count at once, one Python thread each with ``threads_each`` intra-op threads."""
    errors = []

    def one(i):
        try:
            torch.set_num_threads(threads_each)
            work(i)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    workers = [threading.Thread(target=one, args=(i,)) for i in range(1, count)]
    for w in workers:
        w.start()
    one(0)
    for w in workers:
        w.join()
    if errors:
        raise errors[0]


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--rows", default="1,4")
    parser.add_argument("--experts", type=int, default=None, help="experts to pick from (default: the layer's)")
    parser.add_argument("--threads-split", default="2,4,8", help="K of the threads:K variants")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    config = shape_config(args.shape)
    config["num_hidden_layers"] = 1
    model = build_model(config)
    ffn = next(s for s in model if isinstance(s, MoEFFN))
    dtype, D, Fw, k = model.dtype, ffn.hidden, ffn.intermediate, ffn.top_k
    E = args.experts or ffn.num_experts
    gate_up = (torch.randn(E, 2 * Fw, D) * 0.02).to(dtype)
    down = (torch.randn(E, D, Fw) * 0.02).to(dtype)
    source = DictExperts(expert_views(gate_up, down), E)
    stacked_source = DictExperts(expert_views(gate_up, down), E, stack=True)
    all_threads = torch.get_num_threads()
    gemv_mode = os.environ.get("VRAMSHARD_CPU_GEMV", "auto")
    read_gb_s = cpu_read_bandwidth() / 1e9
    expert_bytes = (gate_up[0].numel() + down[0].numel()) * dtype.itemsize
    result = {"date": now(), "hardware": hardware(), "shape": args.shape, "cpu_gemv": cpu_gemv.isa(), "dtype": str(dtype), "threads": all_threads,
              "cpu_read_gb_s": read_gb_s, "expert_mb": expert_bytes / 1e6, "cells": []}
    packed = None
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            h = torch.randn(rows, D).to(dtype)

            def routing() -> Routing:
                experts = torch.stack([torch.randperm(E, generator=generator)[:k] for _ in range(rows)])
                return Routing(experts, torch.full((rows, k), 1.0 / k).to(dtype))

            distinct = len(set(routing().experts.reshape(-1).tolist()))
            bound_ms = distinct * expert_bytes / (read_gb_s * 1e9) * 1e3
            cell = {"rows": rows, "distinct_experts": distinct, "bound_ms": bound_ms}
            torch.set_num_threads(all_threads)
            reference = ffn.run_experts(source, h, fixed := routing())
            cell["layer_ms"] = timed(lambda: ffn.run_experts(source, h, routing()), repeat=args.repeat) * 1e3
            for variant, gemv in (("compiled", "off"), ("gemv", "auto")):
                os.environ["VRAMSHARD_CPU_GEMV"] = gemv  # (read at each call)
                began = time.perf_counter()
                compiled = ffn.run_experts(stacked_source, h, fixed)
                if variant == "compiled":
                    cell["compile_s"] = time.perf_counter() - began
                if host_experts.routed(h, gate_up, down, fixed.experts, fixed.weights) is None:
                    cell[f"{variant}_error"] = "the pass does not run here (see the log)"
                else:
                    torch.testing.assert_close(compiled.float(), reference.float(), rtol=3e-2, atol=3e-3)
                    cell[f"{variant}_ms"] = timed(lambda: ffn.run_experts(stacked_source, h, routing()),
                                                  repeat=args.repeat) * 1e3
            os.environ["VRAMSHARD_CPU_GEMV"] = gemv_mode
            try:
                if packed is None:
                    packed = [(torch.ops.mkldnn._reorder_linear_weight(gate_up[e].contiguous(), 1),
                               torch.ops.mkldnn._reorder_linear_weight(down[e].contiguous(), 1)) for e in range(E)]
                linear = torch.ops.mkldnn._linear_pointwise

                def on_packed(r: Routing) -> torch.Tensor:
                    out = torch.zeros(rows, D, dtype=torch.float32)
                    for t in range(rows):
                        for e, w in zip(r.experts[t].tolist(), r.weights[t].float().tolist()):
                            gate, up = linear(h[t : t + 1], packed[e][0], None, "none", [], "").chunk(2, dim=-1)
                            out[t] += w * linear(F.silu(gate) * up, packed[e][1], None, "none", [], "")[0].float()
                    return out.to(dtype)

                torch.testing.assert_close(on_packed(fixed).float(), reference.float(), rtol=3e-2, atol=3e-3)
                cell["packed_ms"] = timed(lambda: on_packed(routing()), repeat=args.repeat) * 1e3
            except (RuntimeError, AssertionError) as exc:
                cell["packed_error"] = str(exc)[:200]
            for K in (int(x) for x in args.threads_split.split(",")):
                if K > all_threads:
                    continue

                def shared(r: Routing, K=K) -> torch.Tensor:
                    ids = sorted(set(r.experts.reshape(-1).tolist()))
                    groups = [set(ids[i::K]) for i in range(K)]
                    parts = [None] * K

                    def work(i, parts=parts, groups=groups):
                        parts[i] = ffn.run_experts(source, h, r, only=groups[i])

                    run_threads(K, work, max(1, all_threads // K))
                    return sum(parts)

                torch.testing.assert_close(shared(fixed).float(), reference.float(), rtol=3e-2, atol=3e-3)
                cell[f"threads_{K}_ms"] = timed(lambda: shared(routing()), repeat=args.repeat) * 1e3
            torch.set_num_threads(all_threads)
            for key in [c for c in cell if c.endswith("_ms") and c != "bound_ms"]:
                cell[key.removesuffix("_ms") + "_gb_s"] = distinct * expert_bytes / (cell[key] / 1e3) / 1e9
            log.info("%s", rounded(cell))
            result["cells"].append(cell)
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
