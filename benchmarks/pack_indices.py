"""Host time of packing one decode step's indices for a CUDA-graph run (``pack_decode_inputs``).

    PYTHONPATH=src python -m benchmarks.pack_indices --rows 1,64 --contexts 32,1024

A plan that splits FFNs replays some 30 graph runs a step; since ``bf8c5a4`` they share one pack
a step (``runtime/graphs.py``, ``_Indices``) where each run packed its own before. This times
one pack at each (rows, context), and prints what 30 packs a step cost: the host time saved.
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

from vramshard.layers.step import Step
from vramshard.runtime.graphs import _FIXED_COLUMNS, pack_decode_inputs

from .common import hardware, now, write_json

log = logging.getLogger("pack_indices")
BLOCK = 16
RUNS_A_STEP = 30


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,64")
    parser.add_argument("--contexts", default="32,1024")
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    cells = []
    for rows in (int(r) for r in args.rows.split(",")):
        for context in (int(c) for c in args.contexts.split(",")):
            per_slot = -(-(context + 64) // BLOCK)
            blocks = -(-max(64, context + 16) // BLOCK)
            step = Step(list(range(rows)), [context] * rows, [1] * rows, list(range(rows)))
            out = torch.zeros(rows, _FIXED_COLUMNS + blocks, dtype=torch.long)
            for _ in range(3):
                pack_decode_inputs(step, (BLOCK, per_slot), out)
            start = time.perf_counter()
            for _ in range(args.repeat):
                pack_decode_inputs(step, (BLOCK, per_slot), out)
            pack_us = (time.perf_counter() - start) / args.repeat * 1e6
            cell = {"rows": rows, "context": context, "pack_us": pack_us,
                    "saved_ms_a_step": pack_us * (RUNS_A_STEP - 1) / 1e3}
            log.info("%s", {k: round(v, 2) if isinstance(v, float) else v for k, v in cell.items()})
            cells.append(cell)
    if args.json:
        write_json(args.json, {"date": now(), "hardware": hardware(), "args": vars(args), "cells": cells})


if __name__ == "__main__":
    main()
