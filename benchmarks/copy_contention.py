"""How much host→device copies slow while the CPU computes: the profile's contended PCIe table, timed
beside the CPU load the profiler used until session 53 and beside the one it uses now, in one process.

    PYTHONPATH=src python3 -m benchmarks.copy_contention [--seconds 2]

Each case times 64 MiB and 256 MiB pinned host→device copies (the profiler's
:func:`~vramshard.profile.bench_transfer.measure_transfers`, each size's median) and prints their
GB/s with what the CPU load read meanwhile:

  alone       no CPU load;
  old load    fp32 ``[16, 4096] @ [4096, 14336]`` over one 235 MB weight on every torch thread (the
              profiler's ``cpu_load`` until session 53: a large L3 can hold the weight);
  new load    :func:`vramshard.profile.contention.cpu_load`: bf16 one-row products over cold copies of a
              ``[14336, 4096]`` weight, decode's CPU work.

The bound printed beside them is the host's memory shared by both readers at once
(:func:`benchmarks.common.shared_read_bandwidth`: all threads summing 2 GiB of fp32 while copies stay
queued), with the CPU's read and the copies' rate each alone. Writes ``$OUT/copy_contention.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import time

import torch
import torch.nn.functional as F

from vramshard.profile import contention
from vramshard.profile.bench_transfer import measure_transfers
from vramshard.profile.progress import ProgressSink

from .common import cpu_read_bandwidth, hardware, now, out_dir, shared_read_bandwidth, versions, write_json

log = logging.getLogger("copy_contention")
SIZES = [64 * 2**20, 256 * 2**20]


@contextlib.contextmanager
def old_load():
    """The profiler's CPU load until session 53 (its rate: the 235 MB weight's bytes per product)."""
    x, weight = torch.randn(16, 4096), torch.randn(14336, 4096)  # [M, K], [N, K]
    rate = contention.LoadRate()

    def multiply() -> None:
        F.linear(x, weight)
        rate.nbytes += weight.nbytes

    start = time.perf_counter()
    with contention._background("CPU background load", multiply):
        yield rate
    rate.seconds = time.perf_counter() - start


def copies_gbps(seconds: float) -> dict:
    """GB/s of each size's copies, timed for about ``seconds`` in all."""
    table = measure_transfers(SIZES, "h2d", budget_s=seconds / len(SIZES), progress=ProgressSink(),
                              label="h2d", weight=1.0)
    return {f"{b >> 20} MiB": round(b / s / 1e9, 2) for b, s in zip(table["bytes"], table["seconds"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="copy timing per case")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("copy_contention needs a CUDA GPU")
    result = {"date": now(), "hardware": hardware(), "versions": versions(), "args": vars(args), "cases": {}}
    shared = shared_read_bandwidth()
    result["bound"] = {"cpu_read_alone_gb_s": round(cpu_read_bandwidth() / 1e9, 1),
                       "shared": {k: round(v / 1e9, 1) for k, v in shared.items()}}
    log.info("bound: CPU read alone %.1f GB/s; both at once: CPU %.1f + copies %.1f = %.1f GB/s",
             result["bound"]["cpu_read_alone_gb_s"], *(result["bound"]["shared"][k] for k in ("cpu", "h2d", "total")))
    for case, load in (("alone", contextlib.nullcontext), ("old load", old_load), ("new load", contention.cpu_load),
                       ("alone again", contextlib.nullcontext)):
        with load() as reading:
            time.sleep(0.2)  # the load's first products (its path's trials are before it)
            copies = copies_gbps(args.seconds)
        cpu = round(reading.gbps, 1) if reading is not None else None
        result["cases"][case] = {"h2d_gb_s": copies, "cpu_read_gb_s": cpu}
        log.info("%-12s copies %s GB/s; the CPU read %s GB/s meanwhile", case, copies, cpu)
    write_json(out_dir() / "copy_contention.json", result)


if __name__ == "__main__":
    main()
