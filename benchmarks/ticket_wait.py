"""The run-ahead worker's ticket, seen from the GPU: does the stream go on once a host thread
raises it, and how long after?

    PYTHONPATH=src python -m benchmarks.ticket_wait --json out.json

For each way the GPU can write the ready word and wait for the ticket (``stream``: the driver's
``cuStreamWriteValue64`` / ``cuStreamWaitValue64``; ``kernel``: one-thread Triton kernels), a
fresh process runs :class:`RunAhead` the way a split FFN does: the host thread copies an
activation to the host, hands the CPU part (a matmul) to the worker, queues the result's copy
behind the wait, and blocks on the sum (a synchronous copy to the host, as a CPU sub-layer's
input is, while the worker computes). The GPU reaches the wait
before the worker is done (the part takes milliseconds), which is the case a cached read of the
ticket would never leave. Each iteration checks the result against the same matmul on the host
thread, and times the iteration against the part's own compute time: the difference is the
wake-up and copy. A process that does not finish within ``--timeout-s`` is reported as hung.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time

import torch

from .common import hardware, now, write_json

log = logging.getLogger("ticket_wait")


def one_way(iterations: int, rows: int) -> dict:
    """In this process (VRAMSHARD_RUN_AHEAD_WAIT chosen by the parent): the split FFN pattern."""
    from vramshard.runtime import run_ahead

    run_ahead.ENABLED = run_ahead.DENSE = True
    ahead = run_ahead.RunAhead()
    gpu = torch.device("cuda")
    weight = torch.randn(4096, 4096, dtype=torch.bfloat16)
    h_host = torch.empty(rows, 4096, dtype=torch.bfloat16, pin_memory=True)
    out = torch.empty(rows, 4096, dtype=torch.bfloat16, pin_memory=True)
    walls, parts, wrong = [], [], 0
    for i in range(iterations):
        h = torch.randn(rows, 4096, dtype=torch.bfloat16, device=gpu)
        torch.cuda.synchronize()
        start = time.perf_counter()
        h_host.copy_(h, non_blocking=True)
        number = ahead.copied()
        ahead.submit(number, lambda: torch.matmul(h_host, weight, out=out))
        total = (h + out.to(gpu, non_blocking=True)).float().sum().item()  # blocks on the GPU
        walls.append(time.perf_counter() - start)
        computing, _ = ahead.drain()
        parts.append(computing)
        expected = (h.cpu() + torch.matmul(h.cpu(), weight)).float().sum().item()
        wrong += abs(total - expected) > 1e-2 * max(1.0, abs(expected))
    ahead.close()
    return {"mode": "stream" if ahead._stream is not None else "kernel", "iterations": iterations,
            "rows": rows, "wrong": wrong, "wall_ms": 1e3 * statistics.median(walls),
            "part_ms": 1e3 * statistics.median(parts),
            "wake_and_copy_ms": 1e3 * statistics.median(w - p for w, p in zip(walls, parts))}


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ways", default="stream,kernel")
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--timeout-s", type=float, default=40.0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one_way(args.iterations, args.rows)))
        return
    result = {"date": now(), "hardware": hardware(), "cells": []}
    for way in args.ways.split(","):
        command = [sys.executable, "-m", "benchmarks.ticket_wait", "--child", "--iterations", str(args.iterations),
                   "--rows", str(args.rows)]
        env = {**os.environ, "VRAMSHARD_RUN_AHEAD_WAIT": way}
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            cell = {"way": way, "hung": True}
        else:
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            cell = {"way": way, **json.loads(lines[-1])} if done.returncode == 0 and lines else \
                {"way": way, "failed": done.stderr[-1500:]}
        log.info("%s", cell)
        result["cells"].append(cell)
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
