"""Synthetic profiles: the profile format filled from a roofline model of peak numbers.

The planner's tests use these to make the CPU, the GPU or PCIe artificially fast or slow:

    from vramshard.profile import synthetic
    slow_pcie = synthetic(cpu_gflops=400, gpu_gflops=100_000, h2d_gbps=2)
    no_gpu = synthetic(cpu_gflops=400)                       # CPU-only machine
    fast_bf16 = synthetic(cpu_gflops={"bf16": 2000, "fp16": 300, "fp32": 500})

Each time is ``max(flops / peak, bytes / memory bandwidth) + latency``, so decode-size
matmuls are memory-bound and large ones compute-bound, as on real machines.
"""

from __future__ import annotations

import datetime

from .spec import DTYPES, FULL_SHAPES
from .schema import SCHEMA, VERSION

_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
_MS = [1, 4, 16, 64, 256, 1024, 2048]
_RATIO_SHAPES = [(1024, 1024), (4096, 4096), (4096, 14336)]
_RATIO_MS = [1, 16, 256, 2048]
_SIZES = [2**k for k in range(16, 31, 2)]
_N_NEW = [1, 16, 128, 1024]
_CONTEXT = [512, 2048, 8192, 32768]


def _per_dtype(value, what: str) -> dict[str, float]:
    if isinstance(value, dict):
        missing = [d for d in DTYPES if d not in value]
        if missing:
            raise ValueError(f"{what} lacks dtype(s) {missing}; give all of {list(DTYPES)} or one number")
        return {d: float(value[d]) for d in DTYPES}
    return {d: float(value) for d in DTYPES}


def _matmul_time(m, k, n, dtype, gflops, mem_gbps, latency_s) -> float:
    flops = 2.0 * m * k * n
    nbytes = _BYTES[dtype] * (m * k + k * n + m * n)
    return max(flops / (gflops * 1e9), nbytes / (mem_gbps * 1e9)) + latency_s


def _attention_time(n_new, context, heads, kv_heads, head_dim, dtype, gflops, mem_gbps, latency_s) -> float:
    flops = 4.0 * n_new * context * heads * head_dim
    nbytes = _BYTES[dtype] * (2 * context * kv_heads * head_dim + 2 * n_new * heads * head_dim)
    return max(flops / (gflops * 1e9), nbytes / (mem_gbps * 1e9)) + latency_s


def synthetic_data(
    *,
    cpu_gflops: float | dict = 500.0,
    gpu_gflops: float | dict | None = None,
    h2d_gbps: float = 25.0,
    d2h_gbps: float | None = None,
    cpu_mem_gbps: float = 60.0,
    gpu_mem_gbps: float = 2000.0,
    cpu_threads: int = 16,
    dispatch_us: dict | float | None = None,
    cpu_contention: float = 1.15,
    pcie_contention: float = 1.15,
    latency_us: dict | None = None,
) -> dict:
    """A profile dict (see :mod:`vramshard.profile.schema`) from peak numbers.

    - ``cpu_gflops`` / ``gpu_gflops``: peak matmul GFLOP/s, one number or ``{dtype: number}``
      for bf16, fp16, fp32. ``gpu_gflops=None`` makes a CPU-only profile (no GPU, no PCIe).
    - ``h2d_gbps`` / ``d2h_gbps``: pinned PCIe bandwidth in GB/s (d2h defaults to h2d).
    - ``cpu_mem_gbps`` / ``gpu_mem_gbps``: memory bandwidth that bounds small-M matmuls.
    - ``cpu_threads``: all cores; fewer threads scale compute linearly and memory
      bandwidth until half the cores.
    - ``dispatch_us``: per-sub-layer overhead, a number or ``{"cpu": 20, "cuda": 40}``.
    - ``cpu_contention`` / ``pcie_contention``: time multipliers for the CPU under PCIe load
      and PCIe under CPU load.
    - ``latency_us``: fixed time added to each kernel, ``{"cpu": 5, "cuda": 5, "pcie": 10}``.
    """
    cpu = _per_dtype(cpu_gflops, "cpu_gflops")
    gpu = _per_dtype(gpu_gflops, "gpu_gflops") if gpu_gflops is not None else None
    d2h_gbps = h2d_gbps if d2h_gbps is None else d2h_gbps
    latency = {"cpu": 5.0, "cuda": 5.0, "pcie": 10.0, **(latency_us or {})}
    if dispatch_us is None:
        dispatch_us = {"cpu": 20.0, "cuda": 40.0}
    elif not isinstance(dispatch_us, dict):
        dispatch_us = {"cpu": float(dispatch_us), "cuda": float(dispatch_us)}
    threads = sorted({cpu_threads, *[2**p for p in range(16) if 2**p < cpu_threads]})
    shapes = [list(s) for s in FULL_SHAPES]

    def cpu_scale(t: int) -> tuple[float, float]:
        return t / cpu_threads, min(1.0, 2.0 * t / cpu_threads)

    matmul = []
    attention = []
    for dtype in DTYPES:
        for t in threads:
            flop_share, mem_share = cpu_scale(t)
            grid_shapes, grid_ms = (shapes, _MS) if t == cpu_threads else ([list(s) for s in _RATIO_SHAPES], _RATIO_MS)
            seconds = [
                [_matmul_time(m, k, n, dtype, cpu[dtype] * flop_share, cpu_mem_gbps * mem_share, latency["cpu"] / 1e6)
                 for m in grid_ms] for k, n in grid_shapes
            ]
            matmul.append({"device": "cpu", "dtype": dtype, "threads": t, "contended": False,
                           "shapes": grid_shapes, "m": grid_ms, "seconds": seconds, "estimated": 0})
        if gpu is not None:
            ratio_shapes = [list(s) for s in _RATIO_SHAPES]
            seconds = [
                [_matmul_time(m, k, n, dtype, cpu[dtype], cpu_mem_gbps, latency["cpu"] / 1e6) * cpu_contention
                 for m in _RATIO_MS] for k, n in ratio_shapes
            ]
            matmul.append({"device": "cpu", "dtype": dtype, "threads": cpu_threads, "contended": True,
                           "shapes": ratio_shapes, "m": _RATIO_MS, "seconds": seconds, "estimated": 0})
            seconds = [
                [_matmul_time(m, k, n, dtype, gpu[dtype], gpu_mem_gbps, latency["cuda"] / 1e6) for m in _MS]
                for k, n in shapes
            ]
            matmul.append({"device": "cuda", "dtype": dtype, "threads": None, "contended": False,
                           "shapes": shapes, "m": _MS, "seconds": seconds, "estimated": 0})
        for device, peak, bw in (("cpu", cpu, cpu_mem_gbps), ("cuda", gpu, gpu_mem_gbps)):
            if peak is None:
                continue
            seconds = [
                [_attention_time(n, c, 32, 8, 128, dtype, peak[dtype], bw, latency[device] / 1e6) for c in _CONTEXT]
                for n in _N_NEW
            ]
            attention.append({"device": device, "dtype": dtype, "threads": cpu_threads if device == "cpu" else None,
                              "heads": 32, "kv_heads": 8, "head_dim": 128, "n_new": _N_NEW, "context": _CONTEXT,
                              "seconds": seconds, "estimated": 0})
    transfer = []
    if gpu is not None:
        for direction, gbps in (("h2d", h2d_gbps), ("d2h", d2h_gbps)):
            for contended, factor in ((False, 1.0), (True, pcie_contention)):
                seconds = [(size / (gbps * 1e9) + latency["pcie"] / 1e6) * factor for size in _SIZES]
                transfer.append({"direction": direction, "contended": contended, "bytes": _SIZES, "seconds": seconds})
    dispatch = {"cpu": dispatch_us["cpu"] / 1e6}
    if gpu is not None:
        dispatch["cuda"] = dispatch_us["cuda"] / 1e6
    fingerprint = {"synthetic": True, "cpu_count": cpu_threads, "gpu_name": "synthetic" if gpu else None}
    return {
        "schema": SCHEMA, "version": VERSION, "vramshard_version": "synthetic",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "fingerprint": fingerprint, "fingerprint_hash": "synthetic", "quick": False, "synthetic": True,
        "elapsed_s": 0.0, "cpu": {"threads": threads, "default_threads": cpu_threads},
        "matmul": matmul, "transfer": transfer, "attention": attention, "dispatch": dispatch,
    }
