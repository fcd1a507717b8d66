"""One MoE layer's routed experts on a worker thread, alone and beside host threads of several kinds.

    PYTHONPATH=src python -m benchmarks.beside_host [--shape qwen3-30b-a3b] [--threads N] [--json FILE]

The profile times the run-ahead worker's expert pass beside the host thread
(:func:`vramshard.profile.timing.time_cpu_beside_python`), and the planner prices experts-cpu steps
at that rate. Until session 39 that host thread ran pure Python, giving the GIL up only when the
switch interval forced it; the executor's host thread makes a torch call (a launch) every few
microseconds and gives the GIL up in each. This times, at one token (``cpu_gemv.routed_experts``,
the experts drawn at random, ``--layers`` copies walked in turn so they are read cold), the pass:

- ``alone``: on the worker thread, the calling thread idle (waiting in ``join``);
- ``pure_python``: beside the host loop the profile used before session 39;
- ``profile``: beside the profile's host loop now (``time_cpu_beside_python`` itself);
- ``torch_call_every_N_us``: beside a torch call between N microseconds of Python, for a few N;

all at the switch interval the run-ahead worker sets (``run_ahead.SWITCH_INTERVAL_S``), with the
bound: the experts' bytes at the host's read rate (measured before and after, the faster taken).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import threading
import time

import torch

from vramshard.layers import cpu_gemv
from vramshard.profile.timing import time_cpu_beside_python
from vramshard.runtime import run_ahead

from .common import cpu_read_bandwidth, hardware, now, one_token_experts, rounded, write_json

log = logging.getLogger("beside_host")


def on_worker(fn, threads: int, host_loop) -> float:
    """Median seconds of ``fn()`` on a worker thread of ``threads`` torch threads while this thread
    runs ``host_loop(worker)`` (until the worker is done), at the run-ahead worker's switch interval."""
    out: list[float] = []

    def body():
        torch.set_num_threads(threads)
        fn()
        seconds = []
        for _ in range(40):
            began = time.perf_counter()
            fn()
            seconds.append(time.perf_counter() - began)
        out.append(statistics.median(seconds))

    before = sys.getswitchinterval()
    sys.setswitchinterval(run_ahead.SWITCH_INTERVAL_S)
    worker = threading.Thread(target=body)
    try:
        worker.start()
        host_loop(worker)
    finally:
        worker.join()
        sys.setswitchinterval(before)
    return out[0]


def python_seconds(n: int) -> float:
    """Seconds of ``sum(range(n))`` here."""
    began = time.perf_counter()
    for _ in range(1000):
        sum(range(n))
    return (time.perf_counter() - began) / 1000


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--threads", type=int, default=None, help="the worker's team (default: one core fewer)")
    parser.add_argument("--layers", type=int, default=3, help="copies of the layer's experts walked in turn")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if not cpu_gemv.computes(1):
        raise SystemExit("the C kernel does not build here")
    threads = args.threads or run_ahead.largest_team(torch.get_num_threads())
    one, expert_bytes = one_token_experts(args.shape, args.layers)
    read_before = cpu_read_bandwidth()
    cells = {"alone": on_worker(one, threads, lambda worker: worker.join())}

    def pure_python(worker):
        while worker.is_alive():
            sum(range(200))

    cells["pure_python"] = on_worker(one, threads, pure_python)
    profile_s: list[float] = []
    worker_team = threads

    def as_profile():  # (time_cpu_beside_python's lower quartile, as the profile records it)
        profile_s.append(time_cpu_beside_python(one, 0.3, worker_team, run_ahead.SWITCH_INTERVAL_S))

    as_profile()
    cells["profile"] = profile_s[0]
    queued = torch.zeros(16, device="cuda" if torch.cuda.is_available() else "cpu")
    for n in (100, 300, 1000, 3000):
        def loop(worker, n=n):
            while worker.is_alive():
                queued.add_(1.0)
                sum(range(n))

        cells[f"torch_call_every_{python_seconds(n) * 1e6:.1f}_us"] = on_worker(one, threads, loop)
    read_bps = max(read_before, cpu_read_bandwidth())
    bound_s = expert_bytes / read_bps
    result = {"date": now(), "hardware": hardware(), "shape": args.shape, "threads": threads,
              "read_gb_s": read_bps / 1e9, "bound_ms": bound_s * 1e3,
              "cells_ms": {name: seconds * 1e3 for name, seconds in cells.items()},
              "over_alone": {name: seconds / cells["alone"] for name, seconds in cells.items()}}
    log.info("%s", rounded(result))
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
