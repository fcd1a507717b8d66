"""How well a profile measured on another host prices this host's CPU products, by rows: as stored, scaled by
the host's memory read now (the drift check until session 54), and with the compute check as well
(:func:`vramshard.profile.drift.corrected`, ``compute_rows``), in one process.

    PYTHONPATH=src python3 -m benchmarks.compute_drift --profile docs/profiles/h100-run40.json \
        [--rows 8,16,32,64,128,256,512,1024] [--budget-s 0.2]

The H100 machines share one fingerprint and differ in their CPUs (session 53's host ran bf16 products at 64
rows 3.5x slower than the host profiled in session 40), so a stored profile is treated here as this
machine's (its fingerprint replaced) and the engine's checks run on it as they would at load. For
llama3-8b's FFN products (gate/up ``[4096, 14336]``, down ``[14336, 4096]``) in the profile's dtype on all
threads, each row count is timed here the way the profiler times it
(:func:`~vramshard.profile.bench_matmul.measure_matmul`, cold weights) and set against the three prices:
predicted over measured, with the measured TFLOP/s and weight GB/s; where the executor packs
(``VRAMSHARD_CPU_PACKED=on`` without a GPU), each decode-sized row count prepacked too, against the profile's
``packed_ffn`` factor and the one the check prices. The bound beside them is the host's read
(:func:`benchmarks.common.cpu_read_bandwidth`): no product's weight reads faster. Writes
``$OUT/compute_drift.json``.
"""

from __future__ import annotations

import argparse
import copy
import logging
import math
import os
import time

import torch

from vramshard.profile import drift, load
from vramshard.profile.bench_matmul import cold_copies, measure_matmul
from vramshard.profile.fingerprint import fingerprint_hash, machine_fingerprint
from vramshard.profile.progress import ProgressSink
from vramshard.profile.query import DECODE_ROWS, Profile
from vramshard.profile.spec import torch_dtype

from .common import cpu_read_bandwidth, hardware, now, out_dir, versions, write_json

log = logging.getLogger("compute_drift")
SHAPES = [(4096, 14336), (14336, 4096)]  # llama3-8b's gate/up and down projections, [K, N]
ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4}


def as_this_machines(profile: Profile) -> Profile:
    """``profile`` with this machine's fingerprint, so that the drift checks apply to it; on a host with fewer
    cores than the profile's (the development machine), its all-core tables read as this host's all-core ones."""
    data = copy.deepcopy(profile.data)
    cores, default = os.cpu_count() or 1, data["cpu"]["default_threads"]
    if cores < default:
        data["matmul"] = [dict(t, threads=cores if t["threads"] == default else t["threads"]) for t in data["matmul"]
                          if t["threads"] is None or t["threads"] < cores or t["threads"] == default]
        data["attention"] = [dict(t, threads=cores) if t.get("threads") == default else t for t in data["attention"]]
        data["cpu"] = dict(data["cpu"], default_threads=cores,
                           threads=[t for t in data["cpu"]["threads"] if t < cores] + [cores])
    data["fingerprint"] = machine_fingerprint()
    data["fingerprint_hash"] = fingerprint_hash(data["fingerprint"])
    return Profile(data)


def checked(profile: Profile, compute: bool) -> tuple[Profile, float]:
    """``profile`` as an engine would plan with it here (the compute check on or off), and the check's seconds."""
    drift.forget()
    before = os.environ.get("VRAMSHARD_COMPUTE_DRIFT")
    os.environ["VRAMSHARD_COMPUTE_DRIFT"] = "on" if compute else "off"
    try:
        start = time.perf_counter()
        scaled = drift.corrected(profile)
        return scaled, time.perf_counter() - start
    finally:
        if before is None:
            os.environ.pop("VRAMSHARD_COMPUTE_DRIFT")
        else:
            os.environ["VRAMSHARD_COMPUTE_DRIFT"] = before


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", required=True)
    parser.add_argument("--dtype", default="bf16", choices=sorted(ITEMSIZE))
    parser.add_argument("--rows", default="8,16,32,64,128,256,512,1024")
    parser.add_argument("--budget-s", type=float, default=0.2, help="seconds of timing per shape and row count")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    rows = [int(r) for r in args.rows.split(",")]

    stored = as_this_machines(load(args.profile, check_fingerprint=False))
    torch.set_num_threads(stored.default_threads)
    read_only, read_s = checked(stored, compute=False)
    with_compute, both_s = checked(stored, compute=True)
    read_bps = cpu_read_bandwidth()
    prices = {"stored": stored, "read": read_only, "read+compute": with_compute}

    table = measure_matmul("cpu", args.dtype, SHAPES, rows, budget_s=args.budget_s, cap_s=math.inf,
                           progress=ProgressSink(), label="here", weight=1.0)
    cells = []
    for (k, n), measured in zip(table["shapes"], table["seconds"]):
        copies = cold_copies(torch.randn(n, k, dtype=torch_dtype(args.dtype)) * 0.02)  # [N, K] each
        packed = drift.measure_packed(copies, [m for m in rows if m <= DECODE_ROWS])
        del copies
        for m, seconds in zip(table["m"], measured):
            cell = {"k": k, "n": n, "rows": m, "measured_ms": seconds * 1e3, "tflops": 2 * m * k * n / seconds / 1e12,
                    "weight_gb_s": k * n * ITEMSIZE[args.dtype] / seconds / 1e9}
            for name, profile in prices.items():
                cell[f"{name}_over_measured"] = profile.matmul_s(m, k, n, args.dtype, "cpu") / seconds
            if m in packed:  # prepacked over plain: here, in the profile, as the check prices it
                cell.update(packed_over_plain=packed[m] / seconds,
                            stored_packed=stored.packed_ffn_factor(args.dtype, m),
                            checked_packed=with_compute.packed_ffn_factor(args.dtype, m))
                log.info("  prepacked: %.2f x plain here; the profile %.2f, checked %.2f", cell["packed_over_plain"],
                         cell["stored_packed"], cell["checked_packed"])
            cells.append(cell)
            log.info("[%d, %d] @ [%d, %d]: %.2f ms here (%.2f TFLOP/s, %.0f GB/s); predicted / measured: %s", m, k, k,
                     n, seconds * 1e3, cell["tflops"], cell["weight_gb_s"],
                     ", ".join(f"{name} {cell[f'{name}_over_measured']:.2f}" for name in prices))
    within = {name: sum(abs(math.log(c[f"{name}_over_measured"])) <= math.log(1.15) for c in cells) for name in prices}
    log.info("host read %.1f GB/s (the profile's %.1f); read scale x%.2f, compute rows %s; checks %.2f s and %.2f s; "
             "within 15%%: %s of %d", read_bps / 1e9, stored.cpu_read_bps / 1e9 if stored.cpu_read_bps else 0,
             with_compute.cpu_scale, dict(with_compute.compute_rows), read_s, both_s, within, len(cells))
    write_json(out_dir() / "compute_drift.json", {
        "date": now(), "hardware": hardware(), "versions": versions(), "args": vars(args),
        "host_read_gb_s": read_bps / 1e9, "profile_read_gb_s": (stored.cpu_read_bps or 0) / 1e9,
        "read_scale": with_compute.cpu_scale, "compute_rows": [list(r) for r in with_compute.compute_rows],
        "check_s": {"read": read_s, "read+compute": both_s}, "within_15pct": within, "cells": cells})


if __name__ == "__main__":
    main()
