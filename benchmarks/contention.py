"""How much a CPU matmul slows while the copy engine streams host→device: the planner's
contended CPU pace, measured three ways in one process.

    PYTHONPATH=src python3 -m benchmarks.contention [--seconds 3]

Each case times a decode-time CPU matmul (the CPU part of a split nemo-8b FFN: ``[1, 4096] @
[4096, 6480]`` fp16, cold weights cycled over a buffer far larger than the last-level cache)
for ``--seconds`` and prints its GB/s of weights, beside the copy engine's achieved
host→device GB/s over the same time:

  alone       no copies;
  reissued    the profiler's load before the sixth GPU session: a thread queues 1 GiB of
              copies, sleeps until they end, then queues the next (the copy engine idles while
              the thread waits for a core beside the matmul's threads);
  queued      the load the profiler uses now (:func:`vramshard.profile.contention.pcie_load`):
              three batches always queued;
  executor    copies queued from the timing thread itself, as the slot ring issues them.

The physical bound printed beside them is the host's read bandwidth alone (CPU threads) and
the copy engine's rate alone. Writes ``$OUT/contention.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import threading
import time

import torch

from vramshard.profile.bench_matmul import cold_copies
from vramshard.profile.contention import pcie_load

from .common import cpu_read_bandwidth, h2d_bandwidth, hardware, now, out_dir, versions, write_json

log = logging.getLogger("contention")
K, N = 4096, 6480  # the CPU part of a split nemo-8b FFN: 9 of 16 pieces of 11520
BATCH = 256 * 2**20


def time_matmul(weights: list[torch.Tensor], seconds: float, between=None) -> float:
    """GB/s of weights read by ``[1, K] @ W`` cycling over ``weights`` for ``seconds``
    (``between()`` runs after each matmul, untimed)."""
    x = torch.randn(1, K, dtype=weights[0].dtype)
    done, took, i = 0, 0.0, 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        w = weights[i % len(weights)]
        t0 = time.perf_counter()
        torch.nn.functional.linear(x, w)
        took += time.perf_counter() - t0
        done += w.nbytes
        i += 1
        if between is not None:
            between()
    return done / took / 1e9


@contextlib.contextmanager
def reissued_load():
    """The old profiler load: queue 1 GiB, sleep until it ends, queue again."""
    src = torch.empty(BATCH, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(BATCH, dtype=torch.uint8, device="cuda")
    stream, stop, state = torch.cuda.Stream(), threading.Event(), {"bytes": 0}

    def loop():
        while not stop.is_set():
            with torch.cuda.stream(stream):
                for _ in range(4):
                    dst.copy_(src, non_blocking=True)
                done = torch.cuda.Event(blocking=True)
                done.record(stream)
            done.synchronize()
            state["bytes"] += 4 * BATCH

    worker = threading.Thread(target=loop, daemon=True)
    start = time.perf_counter()
    worker.start()
    yield state
    stop.set()
    worker.join()
    state["gbps"] = state["bytes"] / (time.perf_counter() - start) / 1e9


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("contention needs a CUDA GPU")
    weights = cold_copies(torch.randn(N, K, dtype=torch.float16))
    result = {"date": now(), "hardware": hardware(), "versions": versions(), "shape": [1, K, N], "dtype": "fp16",
              "weights_gib": sum(w.nbytes for w in weights) / 2**30, "threads": torch.get_num_threads(),
              "bound": {"cpu_read_gbps": cpu_read_bandwidth() / 1e9, "h2d_gbps": h2d_bandwidth() / 1e9}}
    cases = {}
    cases["alone"] = {"cpu_gbps": time_matmul(weights, args.seconds), "h2d_gbps": 0.0}
    with reissued_load() as state:
        cpu = time_matmul(weights, args.seconds)
    cases["reissued"] = {"cpu_gbps": cpu, "h2d_gbps": state["gbps"]}
    with pcie_load(BATCH) as load:
        cpu = time_matmul(weights, args.seconds)
    cases["queued"] = {"cpu_gbps": cpu, "h2d_gbps": load.gbps}

    # As the executor: copies queued ahead from this thread; keep ~3 batches in flight.
    src = torch.empty(BATCH, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(BATCH, dtype=torch.uint8, device="cuda")
    stream, events, copied = torch.cuda.Stream(), [], [0]

    def top_up():
        while events and events[0].query():
            events.pop(0)
        while len(events) < 3:
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
                events.append(torch.cuda.Event())
                events[-1].record(stream)
            copied[0] += BATCH

    start = time.perf_counter()
    top_up()
    cpu = time_matmul(weights, args.seconds, between=top_up)
    stream.synchronize()
    cases["executor"] = {"cpu_gbps": cpu, "h2d_gbps": copied[0] / (time.perf_counter() - start) / 1e9}
    for name, case in cases.items():
        case["cpu_slowdown"] = cases["alone"]["cpu_gbps"] / case["cpu_gbps"]
        case["host_total_gbps"] = case["cpu_gbps"] + case["h2d_gbps"]
        log.info("%-9s CPU matmul %5.1f GB/s (%.2fx slower than alone), copies %5.1f GB/s, together %5.1f GB/s",
                 name, case["cpu_gbps"], case["cpu_slowdown"], case["h2d_gbps"], case["host_total_gbps"])
    log.info("bounds: CPU read alone %.1f GB/s, copies alone %.1f GB/s", result["bound"]["cpu_read_gbps"],
             result["bound"]["h2d_gbps"])
    result["cases"] = cases
    write_json(out_dir() / "contention.json", result)


if __name__ == "__main__":
    main()
