"""The C kernel of this tree against the same kernel as an earlier revision had it, in one process run,
with the host's read bound.

    PYTHONPATH=src python -m benchmarks.kernel_revisions --against 669130e [--json FILE]

``--against`` is a git revision (its ``src/vramshard/layers/cpu_gemv.c``, read with ``git show``) or a
path to a copy of the source (a machine without the repository's history: write it there first with
``git show REV:src/vramshard/layers/cpu_gemv.c > FILE``). Both sources are built as the engine builds
its kernel (:func:`vramshard.layers.cpu_gemv._load`) and timed on the same weights, one after the
other in each cell:

- ``experts``: one MoE layer of ``--shape``'s routed experts (:func:`cpu_gemv.routed_experts`) at
  each of ``--rows`` tokens, the experts drawn at random from all of the layer's for each call (cold
  in cache, as a decode step meets them); the bound is the distinct experts' bytes at the read rate;
- ``dense``: one and four rows through an 8B model's FFN projections (gate/up 4096 -> 14336 and down
  14336 -> 4096, :func:`cpu_gemv.rows_times_weight`) in bf16 and fp16, eight copies walked in turn
  (about 0.9 GB), so each call reads its weight from memory.

The read rate (:func:`benchmarks.common.cpu_read_bandwidth`, the profile's measure) is taken before
and after the cells; the bound uses the faster of the two.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from vramshard.layers import cpu_gemv
from vramshard.layers.moe import MoEFFN
from vramshard.models import build_model
from vramshard.shapes import shape_config

from .common import cpu_read_bandwidth, hardware, now, rounded, write_json

log = logging.getLogger("kernel_revisions")

DENSE = {"gate/up 4096->14336": (14336, 4096), "down 14336->4096": (4096, 14336)}
COPIES = 8


def source_of(against: str, into: Path) -> Path:
    """The kernel source of ``against`` (a file, or a git revision of this repository) as a file."""
    if Path(against).is_file():
        return Path(against)
    shown = subprocess.run(["git", "show", f"{against}:src/vramshard/layers/cpu_gemv.c"], capture_output=True,
                           text=True, cwd=Path(__file__).resolve().parent.parent)
    if shown.returncode != 0:
        raise SystemExit(f"--against {against!r} is neither a file nor a revision with the kernel: {shown.stderr.strip()}")
    path = into / f"cpu_gemv-{against}.c"
    path.write_text(shown.stdout)
    return path


def build(source: Path):
    """The kernel library built from ``source`` (cached by its text, as the engine caches its own)."""
    kept = cpu_gemv.SOURCE
    cpu_gemv.SOURCE = source
    try:
        return cpu_gemv._load()
    finally:
        cpu_gemv.SOURCE = kept


def median_ms(call, repeat: int, warmup: int = 3) -> float:
    times = []
    for i in range(warmup + repeat):
        began = time.perf_counter()
        call()
        if i >= warmup:
            times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e3


def expert_cells(libs: dict, shape: str, rows: list[int], repeat: int) -> list[dict]:
    config = shape_config(shape)
    config["num_hidden_layers"] = 1
    ffn = next(s for s in build_model(config) if isinstance(s, MoEFFN))
    E, D, F, k, dtype = ffn.num_experts, ffn.hidden, ffn.intermediate, ffn.top_k, ffn.weights[0].dtype
    gate_up = (torch.randn(E, 2 * F, D) * 0.02).to(dtype)
    down = (torch.randn(E, D, F) * 0.02).to(dtype)
    expert_bytes = 3 * F * D * dtype.itemsize
    generator = torch.Generator().manual_seed(0)
    cells = []
    for T in rows:
        x = torch.randn(T, D).to(dtype)
        weights = torch.full((T, k), 1.0 / k)

        def routing() -> torch.Tensor:
            return torch.stack([torch.randperm(E, generator=generator)[:k] for _ in range(T)])

        fixed = routing()
        outputs = [cpu_gemv.routed_experts(x, gate_up, down, fixed, weights, lib=lib).float() for lib in libs.values()]
        for out in outputs[1:]:
            torch.testing.assert_close(out, outputs[0], rtol=2e-2, atol=2e-3)
        distinct = statistics.mean(len(set(routing().reshape(-1).tolist())) for _ in range(200))
        cell = {"work": f"{shape} experts", "rows": T, "bytes": distinct * expert_bytes}
        for name, lib in libs.items():
            cell[f"{name}_ms"] = median_ms(lambda: cpu_gemv.routed_experts(x, gate_up, down, routing(), weights,
                                                                           lib=lib), repeat)
        cells.append(cell)
    return cells


def dense_cells(libs: dict, repeat: int) -> list[dict]:
    cells = []
    for dtype in (torch.bfloat16, torch.float16):
        for name, (N, K) in DENSE.items():
            weights = [(torch.randn(N, K) * 0.02).to(dtype) for _ in range(COPIES)]
            for T in (1, 4):
                x = torch.randn(T, K).to(dtype)
                cell = {"work": f"{name} {str(dtype).removeprefix('torch.')}", "rows": T, "bytes": N * K * dtype.itemsize}
                for lib_name, lib in libs.items():
                    def walk(lib=lib):
                        for w in weights:
                            cpu_gemv.rows_times_weight(x, w, lib=lib)
                    cell[f"{lib_name}_ms"] = median_ms(walk, max(repeat // 4, 3), warmup=1) / COPIES
                cells.append(cell)
            weights = None  # (freed before the next shape)
    return cells


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", required=True, help="a git revision, or a file with that revision's kernel source")
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--rows", default="1,4,16")
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None,
                        help="the kernels' (and the read's) thread count (default: torch's; the run-ahead worker's "
                             "team is one fewer than the cores)")
    parser.add_argument("--experts-only", action="store_true", help="the routed experts' cells alone")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        libs = {"before": build(source_of(args.against, Path(scratch))), "now": build(cpu_gemv.SOURCE)}
    read_before = cpu_read_bandwidth()
    with torch.inference_mode():
        cells = expert_cells(libs, args.shape, [int(r) for r in args.rows.split(",")], args.repeat)
        if not args.experts_only:
            cells += dense_cells(libs, args.repeat)
    read_after = cpu_read_bandwidth()
    read = max(read_before, read_after)
    for cell in cells:
        cell["bound_ms"] = cell["bytes"] / read * 1e3
        for name in libs:
            cell[f"{name}_of_bound"] = cell["bound_ms"] / cell[f"{name}_ms"]
    result = {"date": now(), "hardware": hardware(), "against": args.against, "isa": cpu_gemv.isa(),
              "threads": torch.get_num_threads(), "cpu_read_gb_s": [read_before / 1e9, read_after / 1e9],
              "cells": [rounded(c) for c in cells]}
    print(f"read {read_before / 1e9:.1f} GB/s before the cells, {read_after / 1e9:.1f} after; "
          f"{torch.get_num_threads()} threads, {cpu_gemv.isa()}")
    print(f"{'work':32s} {'rows':>4s} {'bound ms':>9s} {'before ms':>10s} {'now ms':>8s} {'before':>7s} {'now':>6s}")
    for c in cells:
        print(f"{c['work']:32s} {c['rows']:4d} {c['bound_ms']:9.3f} {c['before_ms']:10.3f} {c['now_ms']:8.3f} "
              f"{c['before_of_bound']:7.0%} {c['now_of_bound']:6.0%}")
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
