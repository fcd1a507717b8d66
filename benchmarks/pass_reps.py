"""The profile's timing of the CPU expert pass with 50 timed calls a point (time_cpu's default, before
session 42) and with ``bench_experts.PASS_REPS`` (its point's whole budget), alternating, in one process.

    PYTHONPATH=src python -m benchmarks.pass_reps [--rounds 6] [--budget-s 0.24] [--json PATH]

The quick profile's pass by default (``measure_host_experts("bf16", 1024, 512, 4, [1], 4 x 0.06 s)``,
alone: no GPU needed). Reports each way's rates, their spread (max / min) and median, beside the host's
memory read measured in the same run (the pass's bound: it reads each routed expert once).
"""

from __future__ import annotations

import argparse
import logging
import statistics

from vramshard.profile import bench_experts
from vramshard.profile.progress import ProgressSink

from .common import cpu_read_bandwidth, hardware, now, write_json

log = logging.getLogger("pass_reps")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--budget-s", type=float, default=4 * 0.06)
    parser.add_argument("--shape", default="1024,512,4", help="hidden, expert intermediate, top-k")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    hidden, intermediate, top_k = (int(v) for v in args.shape.split(","))
    ways = {"50 calls": 50, "PASS_REPS": bench_experts.PASS_REPS}
    rates: dict[str, list[float]] = {name: [] for name in ways}
    default = bench_experts.PASS_REPS
    for _ in range(args.rounds):
        for name, reps in ways.items():
            bench_experts.PASS_REPS = reps
            measured = bench_experts.measure_host_experts("bf16", hidden, intermediate, top_k, [1], args.budget_s,
                                                          ProgressSink(), 0.0)
            rates[name].append(measured.alone["1"] / 1e9)
    bench_experts.PASS_REPS = default
    read = cpu_read_bandwidth() / 1e9
    out = {"date": now(), "hardware": hardware(), "args": vars(args), "host_read_gb_s": read,
           "ways": {name: {"max_calls": ways[name], "gb_s": values, "median_gb_s": statistics.median(values),
                           "spread": max(values) / min(values)} for name, values in rates.items()}}
    for name, way in out["ways"].items():
        log.info("%s: median %.1f GB/s (%.0f%% of the host's read, %.1f GB/s), spread %.3f, %s", name,
                 way["median_gb_s"], 100 * way["median_gb_s"] / read, read, way["spread"],
                 [round(v, 1) for v in way["gb_s"]])
    if args.json:
        write_json(args.json, out)


if __name__ == "__main__":
    main()
