"""Shared pieces of the benchmark scripts: timing, bandwidth probes, hardware description."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Callable, TypeVar

import torch


T = TypeVar("T")


def beside_python(work: Callable[[], T], interval_s: float, threads: int | None = None,
                  host_step: Callable[[], None] | None = None) -> T:
    """``work()`` on a worker thread (``threads`` torch threads, default this thread's count, in
    inference mode) while this thread runs Python all the time, as the host thread queuing a step
    does, calling ``host_step`` too between its loops if given; the GIL's switch interval is
    ``interval_s`` meanwhile. Returns what ``work`` returned."""
    result: list = []
    count = threads or torch.get_num_threads()

    def worker_body():
        torch.set_num_threads(count)  # (OpenMP's thread count is per thread)
        with torch.inference_mode():
            result.append(work())

    before = sys.getswitchinterval()
    sys.setswitchinterval(interval_s)
    worker = threading.Thread(target=worker_body)
    try:
        worker.start()
        while worker.is_alive():
            sum(range(200))  # the host thread's Python
            if host_step is not None:
                host_step()
    finally:
        worker.join()
        sys.setswitchinterval(before)
    if not result:
        raise RuntimeError("the work on the worker thread failed (its traceback is above)")
    return result[0]


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def hardware() -> dict:
    info = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "torch": torch.__version__, "python": platform.python_version()}
    try:
        with open("/proc/cpuinfo") as f:
            cores = set()  # (physical id, core id): hardware threads of one core count once
            socket = None
            for line in f:
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if key == "model name":
                    info["cpu"] = value
                elif key == "physical id":
                    socket = value
                elif key == "core id":
                    cores.add((socket, value))
            if cores:
                info["physical_cores"] = len(cores)
    except OSError:
        pass
    try:  # which machine: GPU calls of one session may get different hosts with one fingerprint
        with open("/proc/sys/kernel/random/boot_id") as f:
            info["boot_id"] = f.read().strip()
    except OSError:
        pass
    info["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY", "default")
    # Every switch that changes how the run computes: OpenMP's, and vramshard's own (A/B runs).
    switches = {k: v for k, v in os.environ.items()
                if k.startswith(("OMP_", "GOMP_", "KMP_", "VRAMSHARD_")) and k != "OMP_WAIT_POLICY"}
    if switches:
        info["env"] = dict(sorted(switches.items()))
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = f"{props.name} ({props.total_memory / 2**30:.0f} GiB)"
        info["cuda"] = torch.version.cuda
    return info


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeat: int = 5, warmup: int = 1, budget_s: float = 20.0) -> float:
    """Median seconds of ``fn()`` (GPU work synchronised); fewer repeats once ``budget_s`` is spent."""
    t_begin = time.perf_counter()
    for _ in range(warmup):
        fn()
        sync()
        if time.perf_counter() - t_begin > budget_s / 2:
            break
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
        if time.perf_counter() - t_begin > budget_s:
            break
    return statistics.median(times)


def h2d_bandwidth(nbytes: int = 2**30) -> float:
    """Bytes/s host→device from pinned memory (one large copy)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    seconds = timed(lambda: dev.copy_(host, non_blocking=True), repeat=5)
    del host, dev
    return nbytes / seconds


def cpu_read_bandwidth(nbytes: int = 2**31) -> float:
    """Bytes/s the CPU reads from memory with all torch threads (sum of a large fp32 tensor), timed
    as the profile times it (:func:`vramshard.profile.bench_memory.measure_cpu_read`; until
    2026-12-04 the median of 5 sums rather than their lower quartile)."""
    from vramshard.profile.bench_memory import measure_cpu_read

    return measure_cpu_read(0.2, nbytes)


def shared_read_bandwidth(nbytes: int = 2**31, seconds: float = 1.0) -> dict:
    """Bytes/s the host's memory gives the CPU and the copy engine when both read it at once: all
    torch threads summing a large fp32 tensor while host→device copies stay queued
    (:func:`vramshard.profile.contention.pcie_load`). {"cpu", "h2d", "total"}.

    A step that reads some weights on the CPU and streams the others to the GPU cannot read
    host memory faster than ``total``. That bound holds whenever the memory controller, not
    the two readers, is the limit; the sum of the two rates measured alone does not."""
    from vramshard.profile.contention import pcie_load

    x = torch.ones(nbytes // 4, dtype=torch.float32)
    x.sum()
    with pcie_load(256 * 2**20) as load:
        done, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            x.sum()
            done += nbytes
        cpu = done / (time.perf_counter() - t0)
    del x
    return {"cpu": cpu, "h2d": load.gbps * 1e9, "total": cpu + load.gbps * 1e9}


def scaled_to_this_host(profile, source: str, dtype=None) -> tuple[object, str]:
    """``profile`` with its CPU side scaled to the host's memory read and compute now, as an engine scales
    it when it loads (:func:`vramshard.profile.drift.corrected`, ``dtype`` the model's), and ``source``
    (where it came from) saying by how much."""
    from vramshard.profile import drift

    scaled = drift.corrected(profile, dtype)
    if scaled.cpu_scale != 1.0:
        source += f" (CPU times x{scaled.cpu_scale:.2f}: the host's memory read now)"
    if scaled.compute_rows:
        source += " (CPU compute by rows x" + ", x".join(f"{f:.2f} at {m}" for m, f in scaled.compute_rows) + \
            ": the host's products now)"
    return scaled, source


def cpu_projection_arguments(parser, rows: str) -> None:
    """The arguments of the benchmarks that time one shape's CPU projections at some row counts."""
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rows", default=rows)
    parser.add_argument("--repeats", type=int, default=8, help="timed calls per cell (median; each reads the next weights)")
    parser.add_argument("--json", default=None)


def rounded(cell: dict, digits: int = 3) -> dict:
    """``cell`` with its floats rounded, for a log line."""
    return {k: round(v, digits) if isinstance(v, float) else v for k, v in cell.items()}


def write_json(path: str | Path, data) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str))


def out_dir() -> Path:
    return Path(os.environ.get("OUT", "bench_out"))


def versions() -> dict:
    """Software versions a benchmark table states: vramshard, torch, CUDA, Python, driver, git commit."""
    import subprocess

    import vramshard

    info = {"vramshard": vramshard.__version__, "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version()}
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        timeout=5, check=True).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["commit"] = None  # the device's copy of the tree has no .git
    if torch.cuda.is_available():
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=10,
                                            check=True).stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            info["driver"] = None
    return info


class Deadline:
    """Seconds left of a run that must end before ``limit_s`` (one call on the GPU machine)."""

    def __init__(self, limit_s: float):
        self.start = time.perf_counter()
        self.limit_s = limit_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.limit_s - self.elapsed()


def decode_read_bytes(model, context: int = 0) -> int:
    """Bytes one decode step must read: every distinct weight except an embedding table that
    only a gather of one row touches (a head tied to it still reads it whole), plus the KV cache
    of ``context`` tokens. The denominator of a decode bandwidth bound."""
    specs = {}
    for sublayer in model.sublayers:
        if sublayer.kind != "embed":
            for spec in sublayer.weights:
                specs.setdefault(spec.source, spec)
    return sum(spec.nbytes for spec in specs.values()) + model.kv_bytes_per_token() * context


def coded_link(bandwidth: dict, ratio: float) -> dict:
    """``bandwidth`` (GB/s, as :func:`decode_bound_tok_s` takes it) in raw weight bytes where stream fills cross
    the link coded at ``ratio`` link bytes a raw byte (:mod:`vramshard.runtime.wire_codec`): PCIe, alone and
    beside the CPU's reads, carries 1/ratio raw bytes a byte, and the host memory that both readers share gives
    the copies' share alike. ``bandwidth`` itself where ``ratio`` is 1 (fills raw)."""
    if ratio >= 1:
        return bandwidth
    out = dict(bandwidth, h2d=bandwidth["h2d"] / ratio)
    if "shared_h2d" in bandwidth:
        out["shared_h2d"] = bandwidth["shared_h2d"] / ratio
        out["shared_total"] = bandwidth["shared_cpu"] + out["shared_h2d"]
    return out


def decode_bound_tok_s(outside_bytes: int, bandwidth: dict, read_gb_s: float | None = None) -> tuple[float, float]:
    """(bound, additive bound) on decode tok/s where ``outside_bytes`` of weights are not resident: every one
    crosses PCIe or is read by the CPU, both at once at best (the additive bound), and no faster than host memory
    gives both readers together (``bandwidth["shared_total"]``, where measured; the bound is the smaller).
    ``read_gb_s``: the host's read now, in place of ``bandwidth["cpu_read"]`` (the shared cap scaled alike)."""
    scale = 1.0 if read_gb_s is None else read_gb_s / bandwidth["cpu_read"]
    additive = (bandwidth["h2d"] + scale * bandwidth["cpu_read"]) * 1e9 / outside_bytes
    if "shared_total" not in bandwidth:
        return additive, additive
    return min(additive, scale * bandwidth["shared_total"] * 1e9 / outside_bytes), additive


def median_seconds(fn, reps: int) -> float:
    """Median wall seconds of ``reps`` calls of ``fn`` after one untimed call."""
    fn()
    times = []
    for _ in range(reps):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def one_token_experts(shape: str, layers: int) -> tuple[Callable[[], object], int]:
    """(call, bytes): one token's routed experts of a MoE layer of ``shape`` by the C kernel
    (:func:`vramshard.layers.cpu_gemv.routed_experts`), drawn at random from the layer's for each
    call, walking ``layers`` copies of its bf16 experts in turn (cold in cache, as a decode step meets
    them); the experts' bytes one call reads."""
    from vramshard.layers import cpu_gemv
    from vramshard.shapes import shape_config

    config = shape_config(shape)
    E, D, F, k = (config[key] for key in ("num_experts", "hidden_size", "moe_intermediate_size", "num_experts_per_tok"))
    gate_up = [torch.randn(E, 2 * F, D, dtype=torch.bfloat16) * 0.02 for _ in range(layers)]  # [E, 2F, D]
    down = [torch.randn(E, D, F, dtype=torch.bfloat16) * 0.02 for _ in range(layers)]  # [E, D, F]
    x = torch.randn(1, D, dtype=torch.bfloat16)
    weights = torch.full((1, k), 1.0 / k)
    turn = [0]

    def call():
        turn[0] = (turn[0] + 1) % layers
        experts = torch.randperm(E)[:k].view(1, k)
        return cpu_gemv.routed_experts(x, gate_up[turn[0]], down[turn[0]], experts, weights)

    return call, k * 3 * D * F * 2
