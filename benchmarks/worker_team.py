"""The run-ahead worker's OpenMP team size: CPU parts alone and beside a Python thread, by team.

    PYTHONPATH=src python -m benchmarks.worker_team --json out.json

The run-ahead worker computes CPU parts while the host thread queues GPU work in Python and then
spins in the driver's wait. Its parts took 1.6-2.4x their time alone on the GPU machine's host with
one core fewer (the fourteenth session's ``gil_handoff``), the one-token expert pass 2.3x (the
twenty-fourth session's profile), and keeping the GIL did not change the worker's computing (the
twenty-fifth). An OpenMP team waits at each barrier for its slowest thread: is a smaller team,
beside the busy host thread, faster? (The profile now times the expert pass by team and the planner
gives the worker the fastest: ``profile/bench_experts.py``.)

For each team size of :func:`~vramshard.profile.bench_experts.team_candidates` (one core fewer down
to a quarter of the cores), the median time of
- a Qwen3-30B-A3B layer's one-token expert pass (the compiled pass, 8 of 128 experts), and
- a llama3-8b split FFN's CPU part (a quarter of the FFN's width) at 1 and 64 rows, through the
  engine's CPU path (the SwiGLU and projection paths chosen in place, on the worker as its parts are),
alone on the main thread and on a worker beside a thread running Python (the run-ahead worker's
0.1 ms GIL switch interval), each over weight copies that exceed the last-level cache; for the
largest team also with the Python thread held to one core and the worker's team to the others
(``sched_setaffinity``): does a team thread that shares the Python thread's core slow the team? The
CPU's read bandwidth in the same run bounds the one-token cases.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import statistics
import sys
import threading
import time

import torch

from vramshard.layers import cpu_compiled, host_experts
from vramshard.layers.mlp import swiglu
from vramshard.profile.bench_experts import team_candidates
from vramshard.profile.bench_matmul import cold_bytes
from vramshard.runtime import run_ahead
from vramshard.shapes import shape_config

from .common import beside_python, cpu_read_bandwidth, hardware, now, rounded, write_json
from .compiled_gil import pass_seconds

log = logging.getLogger("worker_team")


def filled(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of small, varied values, made fast (random numbers of gigabytes take a fresh host
    tens of seconds; the timings do not depend on the values)."""
    count = 1
    for size in shape:
        count *= size
    return ((torch.arange(count, dtype=torch.int32) % 251).to(dtype) * 1e-4).reshape(shape)


def expert_layers(hidden: int, inter: int, experts: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copies of one MoE layer's stacked experts (gate_up [E, 2F, D], down [E, D, F]), together
    more than twice the last-level cache."""
    one = experts * 3 * inter * hidden * dtype.itemsize
    return [(filled(experts, 2 * inter, hidden, dtype=dtype), filled(experts, hidden, inter, dtype=dtype))
            for _ in range(max(2, -(-cold_bytes("cpu") // one)))]


def dense_parts(hidden: int, width: int, dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
    """Copies of one split FFN's CPU part (gate, up [width, hidden], down [hidden, width])."""
    one = 3 * width * hidden * dtype.itemsize
    return [{"gate": filled(width, hidden, dtype=dtype), "up": filled(width, hidden, dtype=dtype),
             "down": filled(hidden, width, dtype=dtype)} for _ in range(max(2, -(-cold_bytes("cpu") // one)))]


WARM_CALLS = 25  # calls before the timed ones: the projections' and the SwiGLU's path trials are made in them


def median_part_s(h: torch.Tensor, parts: list[dict[str, torch.Tensor]], repeats: int) -> float:
    """Median seconds of one part through the engine's CPU path (:func:`~vramshard.layers.mlp.swiglu`,
    the way chosen in place), each call on the next copy of the weights; on a worker it runs as the
    run-ahead worker's parts do (:func:`~vramshard.layers.cpu_compiled.gil_kept_free`)."""
    def one(i: int) -> None:
        w = parts[i % len(parts)]
        swiglu(h, w["gate"], w["up"], w["down"])

    with contextlib.ExitStack() as stack:
        if threading.current_thread() is not threading.main_thread():
            stack.enter_context(cpu_compiled.gil_kept_free())
        for i in range(WARM_CALLS):
            one(i)
        times = []
        for i in range(repeats):
            start = time.perf_counter()
            one(i)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def beside_python_pinned(fn, interval_s: float, team: int):
    """``beside_python(fn, ...)`` with this thread held to the first core and the worker (so its
    OpenMP team, made on its first parallel region) to the others: no thread of the team can share
    a core with the thread running Python. None where this system cannot set thread affinities."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None
    before = os.sched_getaffinity(0)

    def pinned():
        os.sched_setaffinity(threading.get_native_id(), set(cores[1:]))
        return fn()

    try:
        os.sched_setaffinity(threading.get_native_id(), {cores[0]})
    except OSError as exc:  # (a container may refuse it)
        log.warning("cannot hold threads to cores here (%s): no pinned timing", exc)
        return None
    try:
        return beside_python(pinned, interval_s, team)
    finally:
        os.sched_setaffinity(threading.get_native_id(), before)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--teams", default=None, help="team sizes to time, e.g. 15,8 (default: team_candidates)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dtype = getattr(torch, args.dtype)
    moe, dense = shape_config("qwen3-30b-a3b"), shape_config("llama3-8b")
    hidden, inter, count, top_k = (moe["hidden_size"], moe["moe_intermediate_size"], moe["num_experts"],
                                   moe["num_experts_per_tok"])
    largest = run_ahead.largest_team(torch.get_num_threads())
    teams = [int(t) for t in args.teams.split(",")] if args.teams else team_candidates(largest)
    releases = cpu_compiled.kernels_release_gil()
    cpu_compiled.kernels_read_threads_at_run_time()
    interval = run_ahead.SWITCH_INTERVAL_S
    read_bps = cpu_read_bandwidth()
    cells = []
    with torch.inference_mode():
        layers = expert_layers(hidden, inter, count, dtype)
        h = filled(1, hidden, dtype=dtype)
        routing = (torch.randperm(count)[:top_k][None], torch.full((1, top_k), 1.0 / top_k, dtype=dtype))
        parts = dense_parts(dense["hidden_size"], dense["intermediate_size"] // 4, dtype)
        expert_bytes = top_k * 3 * inter * hidden * dtype.itemsize
        part_bytes = sum(w.nbytes for w in parts[0].values())
        for team in teams:
            torch.set_num_threads(team)
            pass_seconds(h, layers, routing, 2)  # (compiles, where this team needs its own kernel)

            def expert_pass() -> float:
                return statistics.median(pass_seconds(h, layers, routing, args.repeats))

            work = {"experts 1 row": (expert_pass, expert_bytes)}
            for rows in (1, 64):
                x = filled(rows, dense["hidden_size"], dtype=dtype)
                work[f"dense part {rows} rows"] = (lambda x=x: median_part_s(x, parts, args.repeats), part_bytes)
            for name, (fn, nbytes) in work.items():
                alone = fn()
                beside = beside_python(fn, interval, team)
                cell = {"work": name, "team": team, "alone_ms": alone * 1e3, "beside_python_ms": beside * 1e3,
                        "beside_over_alone": beside / alone, "read_bound_ms": nbytes / read_bps * 1e3}
                pinned = beside_python_pinned(fn, interval, team) if team == largest else None
                if pinned is not None:
                    cell["beside_python_pinned_ms"] = pinned * 1e3
                cells.append(cell)
                log.info("%-18s team %2d: alone %7.3f ms, beside Python %7.3f ms (%.2fx)%s; read bound %.3f ms",
                         name, team, alone * 1e3, beside * 1e3, beside / alone,
                         f", pinned apart {pinned * 1e3:.3f} ms" if pinned is not None else "", nbytes / read_bps * 1e3)
    torch.set_num_threads(largest + 1)
    result = {"date": now(), "hardware": hardware(), "dtype": args.dtype, "host_experts": host_experts.ENABLED,
              "kernels_release_gil": releases, "switch_interval_s": interval, "largest_team": largest,
              "cpu_read_gb_s": read_bps / 1e9, "cells": [rounded(c, 4) for c in cells],
              "command": " ".join(sys.argv)}
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
