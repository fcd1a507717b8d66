"""Is the first CPU matmul after an idle gap slow? The CPU part of a split FFN after the CPU
waited for the GPU, timed matmul by matmul.

In the sixth session's trace of nemo-8b ``planned:2`` the first matmul (gate) of each split
FFN's CPU part ran at 11-17 GB/s and the next two at 44-68 GB/s. The seventh session ruled out
the copy engine (benchmarks/contention.py: 1.13-1.20x). This checks the other suspect: the CPU
part starts after the host waited for the GPU's attention (a few ms), so OpenMP's worker
threads may have gone to sleep and the cores to a deep idle state or a lower clock.

For each gap (ms) and way of waiting, the three matmuls of the CPU part of a split nemo-8b FFN
(9 of 16 pieces, fp16, one token, weights of several layers cycled so they come cold from
memory) are timed one by one right after the gap:

  none       no gap (back to back);
  sleep      ``time.sleep``: every thread idle, as when the host blocks on a CUDA event;
  spin-main  the calling thread polls the clock, OpenMP's workers idle;
  keep-warm  the calling thread runs a tiny parallel op in a loop, so the workers keep spinning;
  cuda-event (with a GPU) a GPU kernel runs for the gap and the host blocks on its event, as the
             executor's ``crossed.synchronize()`` does.

With a GPU every wait runs twice: weights in ordinary memory and in pinned memory (the
executor's host buffers are pinned; the profile's matmul timings use ordinary memory).

With ``--env`` each setting also runs in a child process with that environment
(e.g. ``OMP_WAIT_POLICY=ACTIVE``), since OpenMP reads it at start. Writes ``$OUT/idle_wake.json``.

    PYTHONPATH=src python3 -m benchmarks.idle_wake [--gaps 0,1,4,16] [--env OMP_WAIT_POLICY=ACTIVE]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time

import torch

from vramshard.layers.sublayer import linear
from vramshard.profile.timing import sleep_cycles_per_second
from vramshard.shapes import shape_config

from .common import hardware, now, out_dir, write_json

log = logging.getLogger("idle_wake")
WAITS = ("none", "sleep", "spin-main", "keep-warm", "cuda-event")


def wait(how: str, seconds: float, warm: torch.Tensor, cycles_per_s: float) -> None:
    deadline = time.perf_counter() + seconds
    if how == "cuda-event":
        torch.cuda._sleep(int(seconds * cycles_per_s))
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
    elif how == "sleep":
        time.sleep(seconds)
    elif how == "spin-main":
        while time.perf_counter() < deadline:
            pass
    elif how == "keep-warm":
        while time.perf_counter() < deadline:
            warm.add_(1)  # large enough to be split over every OpenMP thread


def measure(shape: str, gaps: list[float], layers: int, repeat: int) -> dict:
    """GB/s of gate, up and down of the CPU part right after each gap and wait."""
    cfg = shape_config(shape)
    d, f = cfg["hidden_size"], cfg["intermediate_size"]
    rows = f * 9 // 16  # the CPU's share of a split FFN: 9 of 16 pieces
    dtype = torch.float16
    weights = [(torch.randn(rows, d, dtype=dtype), torch.randn(rows, d, dtype=dtype), torch.randn(rows, d, dtype=dtype))
               for _ in range(layers)]
    gpu = torch.cuda.is_available()
    cycles = sleep_cycles_per_second() if gpu else 0.0
    memories = {"ordinary": weights}
    if gpu:
        memories["pinned"] = [tuple(w.pin_memory() for w in layer) for layer in weights]
    x = torch.randn(1, d, dtype=dtype)
    warm = torch.zeros(1 << 18)
    nbytes = rows * d * 2
    cells = []
    for (memory, weights), gap_ms, how in ((m, g, h) for m in memories.items() for g in gaps for h in WAITS):
        if (gap_ms == 0) != (how == "none") or (how == "cuda-event" and not gpu):
            continue
        times = {"gate": 0.0, "up": 0.0, "down": 0.0}
        for i in range(repeat * layers):
            gate, up, down_t = weights[i % layers]
            wait(how, gap_ms / 1e3, warm, cycles)
            t0 = time.perf_counter()
            g = linear(x, gate)  # the executor's CPU projection (its per-shape path choice)
            t1 = time.perf_counter()
            u = linear(x, up)
            t2 = time.perf_counter()
            linear(torch.nn.functional.silu(g) * u, down_t.t())  # down stored transposed, as split
            t3 = time.perf_counter()
            if i >= 2 * layers:  # two passes warm the code paths (and settle the CPU projection's choice)
                times["gate"] += t1 - t0
                times["up"] += t2 - t1
                times["down"] += t3 - t2
        count = (repeat - 2) * layers
        cell = {"memory": memory, "gap_ms": gap_ms, "wait": how,
                **{f"{k}_gbps": nbytes * count / v / 1e9 for k, v in times.items()},
                **{f"{k}_ms": v / count * 1e3 for k, v in times.items()}}
        cells.append(cell)
        log.info("%-8s gap %5.1f ms %-10s gate %5.1f GB/s  up %5.1f  down %5.1f", memory, gap_ms, how,
                 cell["gate_gbps"], cell["up_gbps"], cell["down_gbps"])
    return {"shape": shape, "rows": rows, "bytes_per_matmul": nbytes, "threads": torch.get_num_threads(),
            "env": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")},
            "cells": cells}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="nemo-8b")
    parser.add_argument("--gaps", default="0,1,4,16", help="idle gaps in ms (0: back to back)")
    parser.add_argument("--layers", type=int, default=6, help="layers' weights cycled (cold reads)")
    parser.add_argument("--repeat", type=int, default=5, help="passes over the layers (the first two untimed)")
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE: also run in a child with it")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    gaps = [float(g) for g in args.gaps.split(",")]
    result = measure(args.shape, gaps, args.layers, args.repeat)
    if args.child:
        print(json.dumps(result))
        return 0
    runs = [result]
    for setting in args.env:
        name, _, value = setting.partition("=")
        child = [sys.executable, "-m", "benchmarks.idle_wake", "--child", "--shape", args.shape, "--gaps", args.gaps,
                 "--layers", str(args.layers), "--repeat", str(args.repeat)]
        done = subprocess.run(child, env={**os.environ, name: value}, capture_output=True, text=True, check=False)
        if done.returncode:
            runs.append({"env": {name: value}, "error": done.stderr[-500:]})
            continue
        runs.append(json.loads(done.stdout.splitlines()[-1]))
        for cell in runs[-1]["cells"]:
            log.info("%s: %-8s gap %5.1f ms %-10s gate %5.1f GB/s  up %5.1f  down %5.1f", setting, cell["memory"],
                     cell["gap_ms"], cell["wait"], cell["gate_gbps"], cell["up_gbps"], cell["down_gbps"])
    write_json(out_dir() / "idle_wake.json", {"date": now(), "hardware": hardware(), "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
