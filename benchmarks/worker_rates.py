"""The profile's rates of the CPU expert pass on the run-ahead worker, timed both ways in turn.

    PYTHONPATH=src python -m benchmarks.worker_rates [--shape 2048,768,8] [--rows 1,4] [--rounds 2] [--json FILE]

:func:`vramshard.profile.bench_experts.measure_host_experts` (``on_worker``, as a GPU machine's profile
measures it) with ``VRAMSHARD_RUN_AHEAD_ONE_CALL`` on (the worker's one bound C call, since session 47) and
off (the layer's own code), alternating: GB/s of the assignments' bytes alone and on the worker beside Python.
"""

from __future__ import annotations

import argparse
import logging

from vramshard.profile.bench_experts import measure_host_experts
from vramshard.profile.progress import ProgressSink
from vramshard.runtime import run_ahead

from .common import hardware, now, write_json

log = logging.getLogger("worker_rates")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="2048,768,8", help="hidden, expert width, top-k (Qwen3-30B-A3B's)")
    parser.add_argument("--rows", default="1,4")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=0.5, help="timing budget of each point")
    parser.add_argument("--json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    hidden, width, top_k = (int(v) for v in args.shape.split(","))
    rows = [int(r) for r in args.rows.split(",")]
    runs = []
    for one_call in [True, False] * args.rounds:
        run_ahead.ONE_CALL = one_call
        rates = measure_host_experts("bf16", hidden, width, top_k, rows, args.budget_s, ProgressSink(), 1.0,
                                     on_worker=True)
        if rates is None:
            raise SystemExit("the CPU expert pass does not run here")
        run = {"one_call": one_call, "alone_gb_s": {r: v / 1e9 for r, v in rates.alone.items()},
               "worker_gb_s": {r: v / 1e9 for r, v in rates.worker.items()}, "teams": sorted(rates.teams)}
        log.info("one call %-5s alone %s, on the worker %s", one_call,
                 ", ".join(f"{r} rows {v:.2f}" for r, v in run["alone_gb_s"].items()),
                 ", ".join(f"{r} rows {v:.2f}" for r, v in run["worker_gb_s"].items()))
        runs.append(run)
    if args.json:
        write_json(args.json, {"when": now(), "hardware": hardware(), "shape": [hidden, width, top_k], "runs": runs})


if __name__ == "__main__":
    main()
