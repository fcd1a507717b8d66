"""The CPU part of a dense FFN split between the CPU and the GPU, per byte, in three layouts.

A split FFN computes pieces ``0..k-1`` (of 16 along the intermediate dimension) on the CPU. On
the H200 machine its step measured 1.46x the time per byte of the whole FFN on the CPU, and
the planner predicted far less. This times, for one-token steps over several layers' weights
(cold, as the model reads them):

- ``whole``: the FFN on the CPU, gate/up fused [2F, D] and down [D, F] as stored;
- ``split``: the split layout of today: gate and up rows [r, D] (two matmuls), down stored
  transposed [F, D] so that its first r rows are the part (``down_t[:r].t()``);
- ``stored-down``: the same gate/up, down as stored, its first r columns (a strided view);
- ``piece-major``: a layout where each piece's gate and up rows are adjacent and down is kept
  as one [D, r_p] block per piece: one matmul for gate/up and one batched matmul for down;

and the down projection of the part alone, read from the transposed storage and from the
row-major one.

    PYTHONPATH=src python3 -m benchmarks.split_part_cpu --shape nemo-8b --json $OUT/split_part_cpu.json
"""

from __future__ import annotations

import argparse
import logging
import time

import torch
import torch.nn.functional as F

from vramshard.layers.sublayer import linear
from vramshard.shapes import shape_config

from .common import hardware, now, write_json

PIECES = 16
log = logging.getLogger("split_part_cpu")


def timed(fn, repeat: int) -> float:
    fn()
    fn()  # the projection chooser's trials, and warm-up
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="nemo-8b")
    parser.add_argument("--dtypes", default="float16,bfloat16")
    parser.add_argument("--layers", type=int, default=6, help="layers' weights cycled (cold reads)")
    parser.add_argument("--shares", default="6,9,12", help="pieces of 16 on the CPU")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    config = shape_config(args.shape)
    d, f = config["hidden_size"], config["intermediate_size"]
    if f % PIECES:
        raise SystemExit(f"{args.shape}: intermediate size {f} is not a multiple of {PIECES} pieces")
    rp = f // PIECES  # rows per piece
    rows = []
    with torch.inference_mode():
        for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
            layers = []
            for _ in range(args.layers):
                gate_up = (torch.randn(2 * f, d) * 0.02).to(dtype)  # [2F, D]: gate rows, then up rows
                down = (torch.randn(d, f) * 0.02).to(dtype)  # [D, F]
                layers.append({
                    "gate_up": gate_up, "down": down, "down_t": down.t().contiguous(),  # [F, D]
                    # piece-major: [P, 2, r_p, D] (gate, up of each piece adjacent) and [P, D, r_p]
                    "pm_gate_up": gate_up.view(2, PIECES, rp, d).transpose(0, 1).contiguous(),
                    "pm_down": down.view(d, PIECES, rp).permute(1, 0, 2).contiguous(),
                })
            x = torch.randn(1, d).to(dtype)

            def whole():
                for w in layers:
                    gate, up = linear(x, w["gate_up"]).chunk(2, dim=-1)
                    linear(F.silu(gate) * up, w["down"])

            t_whole = timed(whole, args.repeat)
            for k in (int(s) for s in args.shares.split(",")):
                r = k * rp

                def split():
                    for w in layers:
                        act = F.silu(linear(x, w["gate_up"][:r])) * linear(x, w["gate_up"][f:f + r])
                        linear(act, w["down_t"][:r].t())

                def stored_down():
                    for w in layers:
                        act = F.silu(linear(x, w["gate_up"][:r])) * linear(x, w["gate_up"][f:f + r])
                        linear(act, w["down"][:, :r])

                def piece_major():
                    for w in layers:
                        gu = linear(x, w["pm_gate_up"][:k].reshape(2 * r, d)).view(k, 2, rp)  # [k, 2, r_p]
                        act = (F.silu(gu[:, 0]) * gu[:, 1])[:, :, None]  # [k, r_p, 1]
                        torch.bmm(w["pm_down"][:k], act).sum(dim=0).view(1, d)  # [k, D, 1] -> [1, D]

                share = k / PIECES
                row = {"dtype": str(dtype), "k": k, "share": share, "whole_ms": t_whole * 1e3 / args.layers}
                for name, fn in (("split", split), ("stored-down", stored_down), ("piece-major", piece_major)):
                    t = timed(fn, args.repeat)
                    row[f"{name}_ms"] = t * 1e3 / args.layers
                    row[f"{name}_per_byte_vs_whole"] = t / (t_whole * share)
                # The down projection alone: the same bytes read from the transposed storage (by
                # each call that can), from the row-major storage with its columns sliced.
                act = torch.randn(1, r).to(dtype)
                act_full = torch.randn(1, f).to(dtype)
                for name, fn in (
                        ("down-transposed-linear", lambda: [linear(act, w["down_t"][:r].t()) for w in layers]),
                        ("down-transposed-mm", lambda: [torch.mm(act, w["down_t"][:r]) for w in layers]),
                        ("down-row-major-sliced", lambda: [linear(act, w["down"][:, :r]) for w in layers]),
                        ("down-whole", lambda: [linear(act_full, w["down"]) for w in layers])):
                    row[f"{name}_ms"] = timed(fn, args.repeat) * 1e3 / args.layers
                row["down-whole_ms"] *= share  # the whole down's time for the part's bytes
                rows.append(row)
                log.info("%-14s k=%2d/16: per layer whole %.2f ms; per byte vs whole: split %.2f, stored-down %.2f, "
                         "piece-major %.2f; down part alone: transposed %.2f (linear) / %.2f (mm) ms, row-major "
                         "sliced %.2f ms, whole x share %.2f ms", dtype, k, row["whole_ms"],
                         row["split_per_byte_vs_whole"], row["stored-down_per_byte_vs_whole"],
                         row["piece-major_per_byte_vs_whole"], row["down-transposed-linear_ms"],
                         row["down-transposed-mm_ms"], row["down-row-major-sliced_ms"], row["down-whole_ms"])
    if args.json:
        write_json(args.json, {"date": now(), "hardware": hardware(), "args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
