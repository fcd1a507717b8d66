"""One-row half-precision products on the CPU: the C kernel (``layers/cpu_gemv``) against torch's paths
and the host's read bandwidth, in one process run.

    PYTHONPATH=src python -m benchmarks.cpu_gemv [--dtype bf16] [--threads N] [--out FILE.json]

For each row count (``--rows``, default 1 and 4) and each shape of an 8B model's FFN (gate/up 4096 ->
14336, down 14336 -> 4096 by rows and stored transposed, as a split-ready FFN's down lies in host memory,
and a split part's share of it) it times the rows through: ``F.linear`` on the plain
weight, oneDNN's prepacked weight (``mkldnn._linear_pointwise``, the split parts' path beside a GPU
since session 31) and the C kernel on the plain weight; then a whole split part (SwiGLU of 6 of 16
pieces: gate, up, and down's share, stored transposed) by the prepacked part and by the C kernel, in one call and (as
before session 61) in three with torch's activation between them; then the same part at ``--tiles-rows`` rows
(default 16 and 64) through the C kernel's matrix tiles (AMX, where the CPU has them), oneDNN-prepacked and by
torch, its down row-major. Every timing walks
eight weights in turn (about 0.9 GB at bf16), so each call reads its weight from memory, not from the
last-level cache. GB/s is weight bytes per second; the bound is the host's read
(``benchmarks.common.cpu_read_bandwidth``: the sum of a float32 buffer, as the profile measures it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import platform

import torch
import torch.nn.functional as F

from vramshard.layers import cpu_gemv
from vramshard.runtime.cpu_packed import PackedPart

from .common import median_seconds

log = logging.getLogger("cpu_gemv")

COPIES = 8
# name: (N, K, K kept of the weight or None, stored transposed: w.T [K, N] by rows, as a split-ready
# FFN's down projection lies in host memory)
SHAPES = {"gate/up 4096->14336": (14336, 4096, None, False), "down 14336->4096": (4096, 14336, None, False),
          "down 14336->4096, stored transposed": (4096, 14336, None, True),
          "down part 5376 of 14336, stored transposed": (4096, 14336, 5376, True)}


def _read_gb_s() -> float:
    buffer = torch.ones(2**30 // 4, dtype=torch.float32)
    return buffer.nbytes / median_seconds(buffer.sum, 10) / 1e9


def _projection(name: str, n: int, k: int, width: int | None, transposed: bool, dtype: torch.dtype,
                reps: int, rows: int = 1) -> dict | None:
    if transposed:  # w.T [K, N] by rows; the part: its first ``width`` rows
        weights = [torch.randn(k, n).to(dtype)[:width or k].t() for _ in range(COPIES)]
    else:
        weights = [torch.randn(n, k).to(dtype)[:, :width or k] for _ in range(COPIES)]
    k = width or k
    x = torch.randn(rows, k).to(dtype)
    if not cpu_gemv.takes(x, weights[0]):
        return None  # (stored transposed: one row only)
    nbytes = COPIES * n * k * dtype.itemsize
    row = {"shape": name, "rows": rows, "n": n, "k": k, "part": bool(width), "stored_transposed": transposed}
    row["linear_gb_s"] = nbytes / median_seconds(lambda: [F.linear(x, w) for w in weights], reps) / 1e9
    try:
        packed = [torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), rows) for w in weights]
        row["packed_gb_s"] = nbytes / median_seconds(
            lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in packed], reps) / 1e9
    except RuntimeError as exc:
        row["packed_gb_s"], row["packed_error"] = None, str(exc).splitlines()[0]
    if cpu_gemv.library() is not None:
        row["gemv_gb_s"] = nbytes / median_seconds(lambda: [cpu_gemv.rows_times_weight(x, w) for w in weights], reps) / 1e9
        ref = F.linear(x.float(), weights[0].float())
        row["gemv_max_rel_err"] = ((cpu_gemv.rows_times_weight(x, weights[0]) - ref).abs().max()
                                   / ref.abs().max()).item()
    return row


def _split_part(dtype: torch.dtype, reps: int) -> dict:
    hidden, inter, pieces, on_cpu = 4096, 14336, 16, 6
    r = inter // pieces * on_cpu
    parts = []
    for _ in range(COPIES):
        gate, up, down_t = (torch.randn(inter, hidden).to(dtype), torch.randn(inter, hidden).to(dtype),
                            torch.randn(inter, hidden).to(dtype))  # down stored transposed, as in host memory
        parts.append({"gate_proj": gate[:r], "up_proj": up[:r], "down_proj": down_t[:r].t()})
    h = torch.randn(1, hidden).to(dtype)
    nbytes = COPIES * 3 * r * hidden * dtype.itemsize
    row = {"shape": f"split part: {on_cpu} of {pieces} pieces (r={r})", "rows": 1}
    try:
        packed = [PackedPart(p, 1) for p in parts]
        row["packed_gb_s"] = nbytes / median_seconds(lambda: [p.contribution(h) for p in packed], reps) / 1e9
    except RuntimeError as exc:
        row["packed_gb_s"], row["packed_error"] = None, str(exc).splitlines()[0]
    if cpu_gemv.library() is not None:
        row["gemv_gb_s"] = nbytes / median_seconds(
            lambda: [cpu_gemv.swiglu(h, p["gate_proj"], p["up_proj"], p["down_proj"]) for p in parts], reps) / 1e9
        # The part as three calls of the kernel with torch's activation between them (before session 61's one call).
        row["gemv_three_calls_gb_s"] = nbytes / median_seconds(
            lambda: [_three_calls(h, p["gate_proj"], p["up_proj"], p["down_proj"]) for p in parts], reps) / 1e9
    return row


def _three_calls(h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    act = (F.silu(cpu_gemv.rows_times_weight(h, gate)) * cpu_gemv.rows_times_weight(h, up)).to(h.dtype)
    return cpu_gemv.rows_times_weight(act, down).to(h.dtype)


def _tiles_part(dtype: torch.dtype, reps: int, rows: int) -> dict | None:
    """The split part of :func:`_split_part` at ``rows`` rows, its down row-major (as the executor copies it for
    many rows): through the C kernel's matrix tiles (``VRAMSHARD_CPU_AMX``), oneDNN-prepacked, and torch's."""
    from vramshard.layers.mlp import _swiglu

    if dtype != torch.bfloat16 or cpu_gemv.library() is None or not cpu_gemv.tiles_here():
        return None
    hidden, inter, pieces, on_cpu = 4096, 14336, 16, 6
    r = inter // pieces * on_cpu
    parts = [{"gate_proj": torch.randn(r, hidden).to(dtype), "up_proj": torch.randn(r, hidden).to(dtype),
              "down_proj": torch.randn(hidden, r).to(dtype)} for _ in range(COPIES)]
    h = torch.randn(rows, hidden).to(dtype)
    nbytes = COPIES * 3 * r * hidden * dtype.itemsize
    row = {"shape": f"split part: {on_cpu} of {pieces} pieces (r={r}), down row-major", "rows": rows}
    row["tiles_gb_s"] = nbytes / median_seconds(
        lambda: [cpu_gemv.swiglu(h, p["gate_proj"], p["up_proj"], p["down_proj"]) for p in parts], reps) / 1e9
    row["linear_gb_s"] = nbytes / median_seconds(
        lambda: [_swiglu(h, p["gate_proj"], p["up_proj"], p["down_proj"]) for p in parts], reps) / 1e9
    try:
        packed = [PackedPart(p, rows) for p in parts]
        row["packed_gb_s"] = nbytes / median_seconds(lambda: [p.contribution(h) for p in packed], reps) / 1e9
    except RuntimeError as exc:
        row["packed_gb_s"], row["packed_error"] = None, str(exc).splitlines()[0]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--rows", default="1,4", help="rows of x for the projections (the kernel serves one row in "
                                                      "the engine; more are measured to judge whether it should)")
    parser.add_argument("--tiles-rows", default="16,64", help="rows of a split part through the matrix tiles "
                                                             "(where the CPU has them), against oneDNN and torch")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    result = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
              "torch": torch.__version__, "dtype": args.dtype, "gemv_isa": cpu_gemv.isa(),
              "gemv_failure": cpu_gemv.failure(), "read_gb_s": _read_gb_s(), "rows": []}
    log.info("host read %.1f GB/s, %d threads, C kernel: %s", result["read_gb_s"], result["threads"],
             result["gemv_isa"])
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",") if r):
            for name, (n, k, width, transposed) in SHAPES.items():
                row = _projection(name, n, k, width, transposed, dtype, args.reps, rows)
                if row is not None:
                    result["rows"].append(row)
                    log.info("%s", {key: round(v, 2) if isinstance(v, float) else v for key, v in row.items()})
        result["rows"].append(_split_part(dtype, args.reps))
        log.info("%s", {key: round(v, 2) if isinstance(v, float) else v for key, v in result["rows"][-1].items()})
        for rows in (int(r) for r in args.tiles_rows.split(",") if r):
            row = _tiles_part(dtype, args.reps, rows)
            if row is not None:
                result["rows"].append(row)
                log.info("%s", {key: round(v, 2) if isinstance(v, float) else v for key, v in row.items()})
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
