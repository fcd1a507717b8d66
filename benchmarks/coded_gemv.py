"""Can the CPU read the link codec's blocks faster than the raw weights? A probe, not part of the engine.

One row times a bf16 weight [N, 4096] (one coded block a row, runtime/wire_codec.py), all cores, the weights cold
(past the L3: a ring of copies walked in turn), in one process:

- ``engine kernel``: the engine's C kernel on the raw weights (``cpu_gemv.rows_times_weight``, one row);
- ``raw probe``: the probe's own loop over the raw weights (the same compile as the coded one);
- ``coded probe``: ``benchmarks/coded_gemv.c``, decoding each block in registers (AVX-512BW, VBMI);
- bounds: the raw and the coded bytes at the host's read rate (``benchmarks.common.cpu_read_bandwidth``).

Every product is checked against float64 ``W @ x``. Needs AVX-512BW and VBMI and a C compiler (no GPU):
``PYTHONPATH=src:. python -m benchmarks.coded_gemv [--rows 14336] [--out results.json]``
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from vramshard.layers import cpu_gemv
from vramshard.runtime.wire_codec import BLOCK, CODED_BLOCK, ESCAPE, encode_blocks

from .common import cpu_read_bandwidth

log = logging.getLogger("coded_gemv")
SOURCE = Path(__file__).with_name("coded_gemv.c")


def build() -> ctypes.CDLL:
    compiler = cpu_gemv._compiler()
    if compiler is None:
        raise SystemExit("no C compiler")
    target = Path(tempfile.mkdtemp()) / "coded_gemv.so"
    done = subprocess.run([compiler, *cpu_gemv.FLAGS, str(SOURCE), "-o", str(target)], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the probe did not build (it needs AVX-512BW and VBMI): {done.stderr[-400:]}")
    lib = ctypes.CDLL(str(target))
    shutil.rmtree(target.parent)  # (loaded: the file is no longer needed)
    p, n, i = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    lib.vs_coded_rows.argtypes = [p, n, p, p, i]
    lib.vs_raw_rows.argtypes = [p, n, p, p, i]
    return lib


def ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def timed_over(copies: list, fn, repeats: int) -> float:
    """Median seconds of ``fn(copy)``, the copies walked in turn (each cold when its turn comes)."""
    fn(copies[0])
    times = []
    for r in range(repeats):
        began = time.perf_counter()
        fn(copies[r % len(copies)])
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=14336)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--cold-mib", type=int, default=512, help="the ring of copies walked in turn (past the L3)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    lib, threads = build(), torch.get_num_threads()
    n = args.rows
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(n, BLOCK, generator=g) * 0.02).to(torch.bfloat16)
    coded = encode_blocks(weight.view(torch.int16).view(-1)).contiguous().view(-1)
    assert not coded.view(n, CODED_BLOCK)[:, ESCAPE].any(), "a block overflowed: the probe does not handle it"
    cold = args.cold_mib << 20
    raws = [weight.clone() for _ in range(max(1, cold // weight.nbytes))]
    codeds = [coded.clone() for _ in range(max(1, cold // coded.numel()))]
    x = torch.randn(BLOCK, generator=g)
    xb = x.to(torch.bfloat16)
    x = xb.float()  # (the engine's kernel reads a bf16 row: all three see the same x)
    lib.vs_prepare()
    y = torch.empty(n)
    reference = weight.double() @ x.double()
    results = {}

    def coded_rows(c):
        lib.vs_coded_rows(ptr(c), n, ptr(x), ptr(y), threads)

    def raw_rows(w):
        lib.vs_raw_rows(ptr(w), n, ptr(x), ptr(y), threads)

    def engine_kernel(w):
        y.copy_(cpu_gemv.rows_times_weight(xb.view(1, -1), w).view(-1))

    for name, fn, over, nbytes in (("engine kernel", engine_kernel, raws, weight.nbytes),
                                   ("raw probe", raw_rows, raws, weight.nbytes),
                                   ("coded probe", coded_rows, codeds, coded.numel())):
        seconds = timed_over(over, fn, args.repeats)
        error = float((y.double() - reference).abs().max() / reference.abs().max())
        results[name] = {"seconds": seconds, "bytes": nbytes, "gb_s_raw_equivalent": weight.nbytes / seconds / 1e9,
                         "max_rel_error": error}
        log.info("%-14s %.3f ms, %.1f GB/s of raw weights (reads %.1f MB); max error %.1e of the largest",
                 name, seconds * 1e3, weight.nbytes / seconds / 1e9, nbytes / 1e6, error)
    read = cpu_read_bandwidth()
    results["host_read_gb_s"] = read / 1e9
    results["raw_bound_s"], results["coded_bound_s"] = weight.nbytes / read, coded.numel() / read
    log.info("host read %.1f GB/s: raw bound %.3f ms, coded bound %.3f ms; coded probe %.2fx the raw probe, "
             "%.2fx the engine's kernel", read / 1e9, results["raw_bound_s"] * 1e3, results["coded_bound_s"] * 1e3,
             results["raw probe"]["seconds"] / results["coded probe"]["seconds"],
             results["engine kernel"]["seconds"] / results["coded probe"]["seconds"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "rows": n, "threads": threads,
                       "results": results}, f, indent=1)
    return 0 if all(r["max_rel_error"] < 1e-4 for k, r in results.items() if isinstance(r, dict)) else 1


if __name__ == "__main__":
    raise SystemExit(main())
