"""A split FFN's down projection copied row-major: the C library's tiled transpose against torch's copy.

    PYTHONPATH=src python -m benchmarks.down_copy [--threads 1,2,16] [--json out.json]

A splittable FFN stores ``down_proj`` transposed ([F, D]); the CPU part of its first pieces is the view
``down_t[:r].t()`` ([D, r], rows strided), which the CPU's products of many rows read slowly, so the
executor copies it row-major (:mod:`vramshard.runtime.cpu_down`). Per cell (a part of a real shape, a
thread count), medians over fresh outputs as the executor makes them:

- ``kernel``: the executor's copy (:func:`vramshard.runtime.cpu_down.row_major_copy`: the C library's tiled
  transpose into host memory on 2 MiB pages);
- ``torch``: ``view.contiguous()``, the executor's copy until session 37 (one thread, whatever torch's count);
- ``bound``: a plain copy of the same bytes into the same kind of pages (the same reads and writes, in order),
  the rate a transpose cannot beat.

Also the load's split layout (:func:`vramshard.runtime.host_weights.pack_sublayer`): a whole FFN's down
[D, F] from the checkpoint stored transposed ([F, D]), by the library (``store_kernel``) and by torch
(``store_torch``), per thread count.

Then the cost of one copy per FFN: the executor copies an FFN's widest CPU part once, and a part of fewer
pieces (another tier's) reads the copy's leading columns, a [D, r] view at the wider row stride. Per part and
row count, the down product ``F.linear(act, down)`` from such a view (the part's pieces in a copy of
``--wider`` more pieces) against a copy of the part's own width.
"""

from __future__ import annotations

import argparse
import logging

import torch

from vramshard.layers import cpu_gemv
from vramshard.runtime import cpu_down
from vramshard.runtime.host_weights import _fill
from vramshard.runtime.pinned_host import host_empty

from .common import hardware, median_seconds, now, rounded, write_json

log = logging.getLogger("down_copy")

# (name, hidden D, intermediate F, pieces of 16 on the CPU)
PARTS = (("llama3-8b, 7 of 16 pieces", 4096, 14336, 7), ("nemo-8b, 9 of 16 pieces", 5120, 14336, 9),
         ("qwen2.5-1.5b, 8 of 16 pieces", 1536, 8960, 8))


def median_ms(call, repeats: int) -> float:
    return median_seconds(call, repeats) * 1e3


def plain_copy(plain: torch.Tensor) -> torch.Tensor:
    """``plain`` copied in order into host memory of the kind the executor's copies take."""
    return host_empty(plain.nbytes).view(plain.dtype).view(plain.shape).copy_(plain)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default=f"1,{torch.get_num_threads()}")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", default=None)
    parser.add_argument("--wider", type=int, default=3, help="pieces the widest copy has beyond the part's")
    parser.add_argument("--rows", default="16,64", help="rows of the down products timed")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if cpu_gemv.library() is None:
        raise SystemExit(f"the C library is not built here: {cpu_gemv.failure()}")
    result = {"date": now(), "hardware": hardware(), "dtype": args.dtype, "cells": []}
    for name, hidden, intermediate, pieces in PARTS:
        stored = (torch.randn(intermediate, hidden) * 0.02).to(dtype)  # down_proj stored transposed [F, D]
        view = stored[: intermediate * pieces // 16].t()  # the part's down [D, r]
        plain = view.t().contiguous()  # (the same bytes in order, for the bound)
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            cell = {"part": name, "shape": list(view.shape), "threads": threads, "mib": view.nbytes / 2**20,
                    "kernel_ms": median_ms(lambda: cpu_down.row_major_copy(view), args.repeats),
                    "torch_ms": median_ms(lambda: view.contiguous(), args.repeats),
                    "bound_ms": median_ms(lambda: plain_copy(plain), args.repeats)}
            assert torch.equal(cpu_down.row_major_copy(view), view)
            for way in ("kernel", "torch", "bound"):
                cell[f"{way}_gb_s"] = view.nbytes / cell[f"{way}_ms"] / 1e6
            log.info("%s", rounded(cell))
            result["cells"].append(cell)
        checkpoint = stored.t().contiguous()  # down [D, F] as a checkpoint holds it
        target = torch.empty_like(stored)  # [F, D]: the split layout's storage
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            cell = {"part": name, "store": list(checkpoint.shape), "threads": threads,
                    "store_kernel_ms": median_ms(lambda: _fill(target.t(), checkpoint), args.repeats),
                    "store_torch_ms": median_ms(lambda: target.copy_(checkpoint.t()), args.repeats)}
            _fill(target.t(), checkpoint)
            assert torch.equal(target.t(), checkpoint)
            log.info("%s", rounded(cell))
            result["stores"] = result.get("stores", []) + [cell]
        wide = cpu_down.row_major_copy(stored[: intermediate * (pieces + args.wider) // 16].t())
        exact = cpu_down.row_major_copy(view)
        narrow = wide[:, : view.shape[1]]  # the part's columns of the wider copy
        for rows in (int(r) for r in args.rows.split(",")):
            act = (torch.randn(rows, view.shape[1]) * 0.1).to(dtype)
            cell = {"part": name, "rows": rows, "threads": torch.get_num_threads(), "wider_pieces": args.wider,
                    "own_width_ms": median_ms(lambda: torch.nn.functional.linear(act, exact), args.repeats),
                    "in_wider_copy_ms": median_ms(lambda: torch.nn.functional.linear(act, narrow), args.repeats)}
            cell["wider_over_own"] = cell["in_wider_copy_ms"] / cell["own_width_ms"]
            log.info("%s", rounded(cell))
            result["products"] = result.get("products", []) + [cell]
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
