"""Does the CPU read pinned host memory as fast as pageable memory?

The executor keeps every host weight pinned (the copy engine streams from it), while the profile
times its CPU matmuls over ordinary pageable tensors. On the H200 machine the report's CPU-only
cells (`layers:max`, no streaming) decode ~1.3-1.4x slower than the profile predicts, and the
engine's in-run calibration fits a CPU factor of 1.55-1.62 at one token. Pinned memory is locked
in 4 KiB pages where a large pageable tensor may get transparent huge pages, which would make the
CPU's sequential reads of pinned weights slower. This times one-token projections (the
executor's ``cpu_linear`` path, settled first) over ``--gib`` of weights of one real shape, cold
(each weight read once per pass), alternating pageable and pinned copies of the same weights so
the host's drift hits both:

    PYTHONPATH=src python3 -m benchmarks.pinned_cpu_read --json $OUT/pinned_cpu_read.json

Prints and writes GB/s per (dtype, memory kind), the passes' times, and the machine's THP
settings and AnonHugePages before and after the allocations; then the same projection timed as
the profile times its table points (``profile_method_gb_s``; ``profile_over_pageable`` above 1:
the profile's way reads faster than a walk over ``--gib`` of weights, as a model's step does).

The nineteenth GPU session (2026-12-03): pinned took 0.97-1.04x pageable (bf16 and fp16, 4096 x
14336 and 4096 x 4096), so pinning is not the 1.4x; the walks ran at 47-68 GB/s where the
profile of 2026-12-02 had 71-84 GB/s for the same shapes (another run, another day).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import torch

from vramshard.layers.cpu_linear import cpu_linear, settle
from vramshard.profile.bench_matmul import measure_matmul
from vramshard.profile.progress import ProgressSink
from vramshard.profile.spec import BenchmarkSpec, torch_dtype

log = logging.getLogger("pinned_cpu_read")


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError as exc:
        return f"unreadable ({exc})"


def _anon_huge_kib() -> int | None:
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return None


def weights(dtype: torch.dtype, count: int, n: int, k: int, pinned: bool) -> list[torch.Tensor]:
    """``count`` [n, k] weights (as nn.Linear stores them), pinned or pageable."""
    out = []
    for _ in range(count):
        w = torch.empty(n, k, dtype=dtype).uniform_(-0.03, 0.03)  # (randn in float32 took most of a call)
        out.append(w.pin_memory() if pinned else w)
    return out


def pass_s(x: torch.Tensor, ws: list[torch.Tensor]) -> float:
    """Seconds of one projection of ``x`` by every weight in turn."""
    start = time.perf_counter()
    for w in ws:
        cpu_linear(x, w)
    return time.perf_counter() - start


def profile_method_gb_s(dtype_name: str, n: int, k: int) -> float:
    """GB/s of the same one-token projection timed as ``vramshard profile`` times its CPU table
    points (:func:`vramshard.profile.bench_matmul.measure_matmul`: a ring of cold copies of at
    least 512 MiB, median of repeats), in this process: the profile's figure beside the walks."""
    spec = BenchmarkSpec()
    table = measure_matmul("cpu", dtype_name, [(k, n)], [1], budget_s=spec.point_budget_s, cap_s=spec.point_cap_s,
                           progress=ProgressSink(), label="profile method", weight=1.0)
    return k * n * torch_dtype(dtype_name).itemsize / table["seconds"][0][0] / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=4.0, help="GiB of weights per memory kind and dtype")
    parser.add_argument("--shape", default="14336,4096", help="N,K of each weight (default a llama3-8b up projection)")
    parser.add_argument("--dtypes", default="bf16,fp16")
    parser.add_argument("--passes", type=int, default=6)
    parser.add_argument("--json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    n, k = (int(v) for v in args.shape.split(","))
    result = {"shape": [n, k], "threads": torch.get_num_threads(), "cuda": torch.cuda.is_available(),
              "thp_enabled": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
              "thp_defrag": _read("/sys/kernel/mm/transparent_hugepage/defrag"),
              "anon_huge_kib_before": _anon_huge_kib(), "dtypes": {}}
    if not torch.cuda.is_available():
        raise SystemExit("pinned memory needs CUDA: run this on the GPU machine")
    names = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    for name in args.dtypes.split(","):
        dtype = names[name]
        count = max(1, int(args.gib * 2**30 // (n * k * dtype.itemsize)))
        kinds = {"pageable": weights(dtype, count, n, k, pinned=False),
                 "pinned": weights(dtype, count, n, k, pinned=True)}
        result[f"anon_huge_kib_after_{name}"] = _anon_huge_kib()
        x = torch.randn(1, k, dtype=dtype)
        for ws in kinds.values():
            settle(lambda ws=ws: cpu_linear(x, ws[0]))
            pass_s(x, ws)  # first touch
        times: dict[str, list[float]] = {kind: [] for kind in kinds}
        for _ in range(args.passes):
            for kind, ws in kinds.items():
                times[kind].append(pass_s(x, ws))
        nbytes = count * n * k * dtype.itemsize
        row = {kind: {"median_s": statistics.median(t), "gb_s": nbytes / statistics.median(t) / 1e9, "passes_s": t}
               for kind, t in times.items()}
        row["pinned_over_pageable"] = row["pinned"]["median_s"] / row["pageable"]["median_s"]
        row["bytes"] = nbytes
        del kinds
        row["profile_method_gb_s"] = profile_method_gb_s(name, n, k)
        row["profile_over_pageable"] = row["profile_method_gb_s"] / row["pageable"]["gb_s"]
        result["dtypes"][name] = row
        log.info("%s, %d weights [%d, %d] (%.2f GB): pageable %.1f GB/s, pinned %.1f GB/s (pinned takes %.2fx); "
                 "the profile's way %.1f GB/s (%.2fx the pageable walk)", name, count, n, k, nbytes / 1e9,
                 row["pageable"]["gb_s"], row["pinned"]["gb_s"], row["pinned_over_pageable"],
                 row["profile_method_gb_s"], row["profile_over_pageable"])
    print(json.dumps({key: value for key, value in result.items() if key != "dtypes"}))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
