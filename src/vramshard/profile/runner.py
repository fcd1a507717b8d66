"""Run the micro-benchmarks of a :class:`BenchmarkSpec` and assemble a :class:`Profile`."""

from __future__ import annotations

import contextlib
import datetime
import logging
import time

import torch

from .. import __version__
from ..errors import ProfileError
from ..layers import host_experts
from .bench_attention import measure_attention
from .bench_dispatch import measure_dispatch, measure_graph_replay
from .bench_experts import measure_host_experts
from .bench_matmul import measure_matmul
from .bench_memory import measure_cpu_gather, measure_cpu_read
from .bench_packed import measure_packed_ffn, measure_tiles_ffn, tiles_rows
from .bench_split import measure_split_part
from .bench_transfer import faster_of, measure_transfers
from .bench_decode import measure_vram_decode
from .bench_fill_issue import measure_fill_issue
from .bench_zero_copy import measure_zero_copy
from .contention import cpu_load, pcie_load
from .fingerprint import fingerprint_hash, machine_fingerprint
from ..layers import cpu_gemv
from ..runtime import host_load
from .progress import ProgressSink, TableClock
from .query import Profile
from .schema import SCHEMA, VERSION
from .spec import BenchmarkSpec, torch_dtype
from .timing import StealGuard

log = logging.getLogger(__name__)
# Dispatch costs microseconds and any interruption adds to it: the fastest of many batches, over
# half a second on every profile (it is cheap). With 0.16 s and 9 batches two runs on the H200
# machine differed by 16% on the GPU side.
DISPATCH_BUDGET_S = 0.5
READ_BUDGET_S = 0.1  # each of the two host-read timings (start and end of the CPU tables)

_OVERHEAD_S = 0.01  # per point: allocation and bookkeeping, for the time estimate


def _weights(spec: BenchmarkSpec, threads: list[int], use_gpu: bool) -> dict[str, float]:
    """Expected seconds per point of each kind, for the progress bar's time left."""
    cpu_point = spec.point_budget_s * 1.3 + _OVERHEAD_S
    gpu_point = spec.gpu_point_budget_s * 1.5 + _OVERHEAD_S
    return {"cpu": cpu_point, "gpu": gpu_point, "transfer": gpu_point * 1.5, "dispatch": 0.25,
            "split": 4 * cpu_point + 1.0}  # four timings, and random weights of several layers


def _total_weight(spec: BenchmarkSpec, threads: list[int], use_gpu: bool, w: dict) -> float:
    full = len(spec.shapes) * len(spec.ms) * len(spec.dtypes)
    ratio = len(spec.ratio_shapes) * len(spec.ratio_ms) * len(spec.dtypes)
    attn = len(spec.attention_n_new) * len(spec.attention_context) * len(spec.dtypes) * len(spec.attention_heads)
    total = (full * spec.cpu_rounds + ratio * (len(threads) - 1) + attn * spec.cpu_rounds) * w["cpu"] + w["dispatch"]
    if spec.split_ffn:
        total += len(spec.dtypes) * w["split"] * (2 if spec.packed_rows else 1)
        if "bf16" in spec.dtypes and tiles_rows(spec.packed_rows) and cpu_gemv.tiles_here():
            total += w["split"]
    if spec.host_experts:
        total += sum(torch_dtype(d) in host_experts.DTYPES for d in spec.dtypes) * w["split"]
    if use_gpu:
        total += (full + attn) * w["gpu"] + 2 * w["dispatch"]  # (launches and graphs; a coded fill's issue)
        # (alone twice, contended; the zero-copy reads; the decode of coded weights)
        total += (6 * len(spec.transfer_sizes) + 2) * w["transfer"]
        if spec.cpu_contention:
            total += ratio * w["cpu"]
    return total


@contextlib.contextmanager
def _torch_threads(count: int):
    saved = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def run_profile(spec: BenchmarkSpec | None = None, progress: ProgressSink | None = None) -> Profile:
    """Measure this machine as ``spec`` says (default: the full profile) and return the Profile.

    Without CUDA (or with ``spec.gpu=False``) the profile is CPU-only: no GPU or PCIe tables.
    """
    spec = spec or BenchmarkSpec.full()
    spec.validate()
    # Where the profile's time goes (``elapsed_by_table_s``) and what else ran on the CPUs meanwhile (``host_beside``).
    clock = TableClock(progress or ProgressSink(), load=host_load.OtherLoad())
    progress = clock
    use_gpu = torch.cuda.is_available() if spec.gpu is None else spec.gpu
    if use_gpu and not torch.cuda.is_available():
        raise ProfileError("a GPU profile was asked for but CUDA is not available; drop the GPU request")
    threads = spec.resolved_threads()
    top = threads[-1]
    w = _weights(spec, threads, use_gpu)
    progress.start(_total_weight(spec, threads, use_gpu, w))
    started = time.perf_counter()
    matmul: list[dict] = []
    attention: list[dict] = []
    transfer: list[dict] = []
    dispatch: dict[str, float] = {}
    split_part: dict[str, float] = {}
    packed_ffn: dict[str, dict[str, float]] = {}
    tiles_ffn: dict[str, dict[str, float]] = {}
    host_expert_factors: dict[str, dict[str, float]] = {}
    host_experts_on_worker: dict[str, dict[str, float]] = {}
    worker_teams: dict[str, dict[str, float]] = {}
    # The CPU tables' points timed again where the virtual machine's host stole the CPUs (timing.StealGuard).
    steal_guard = StealGuard(host_load.OtherLoad())
    cpu_args = {"budget_s": spec.point_budget_s, "cap_s": spec.point_cap_s, "progress": progress, "weight": w["cpu"],
                "steal_guard": steal_guard}
    gpu_args = {"budget_s": spec.gpu_point_budget_s, "cap_s": spec.point_cap_s, "progress": progress, "weight": w["gpu"]}

    with torch.inference_mode():
        with _torch_threads(top):
            progress.step("cpu memory read")
            reads = [measure_cpu_read(READ_BUDGET_S)]
            progress.step("cpu KV gather")
            gather = measure_cpu_gather(READ_BUDGET_S)
            progress.step("cpu dispatch cost")
            dispatch["cpu"] = measure_dispatch("cpu", DISPATCH_BUDGET_S)
            progress.advance(w["dispatch"])
            for dtype in spec.dtypes:
                table = measure_matmul("cpu", dtype, spec.shapes, spec.ms, label=f"cpu matmul {dtype} threads={top}", **cpu_args)
                matmul.append({"device": "cpu", "dtype": dtype, "threads": top, "contended": False, **table})
        for count in threads[:-1]:
            with _torch_threads(count):
                for dtype in spec.dtypes:
                    table = measure_matmul("cpu", dtype, spec.ratio_shapes, spec.ratio_ms,
                                           label=f"cpu matmul {dtype} threads={count}", **cpu_args)
                    matmul.append({"device": "cpu", "dtype": dtype, "threads": count, "contended": False, **table})
        with _torch_threads(top):
            for dtype in spec.dtypes:
                for heads, kv_heads, head_dim in spec.attention_heads:
                    table = measure_attention("cpu", dtype, heads, kv_heads, head_dim, spec.attention_n_new,
                                              spec.attention_context, label=f"cpu attention {dtype}", **cpu_args)
                    attention.append({"device": "cpu", "dtype": dtype, "threads": top, **table})
                if spec.split_ffn:
                    split_part[dtype] = measure_split_part(dtype, *spec.split_ffn, budget_s=4 * spec.point_budget_s,
                                                           progress=progress, weight=w["split"])
                    if spec.packed_rows:
                        factors = measure_packed_ffn(dtype, *spec.split_ffn, spec.packed_rows,
                                                     budget_s=4 * spec.point_budget_s, progress=progress,
                                                     weight=w["split"])
                        if factors is not None:  # (None: oneDNN cannot pack this dtype here)
                            packed_ffn[dtype] = factors
                        tiles = measure_tiles_ffn(dtype, *spec.split_ffn, spec.packed_rows,
                                                  budget_s=4 * spec.point_budget_s, progress=progress,
                                                  weight=w["split"])
                        if tiles is not None:  # (None: no matrix tiles here, or not this dtype)
                            tiles_ffn[dtype] = tiles
                if spec.host_experts and torch_dtype(dtype) in host_experts.DTYPES:
                    # On the run-ahead worker too where there is one (it needs a GPU).
                    rates = measure_host_experts(dtype, *spec.host_experts, spec.host_expert_rows,
                                                 budget_s=4 * spec.point_budget_s, progress=progress,
                                                 weight=w["split"], on_worker=use_gpu)
                    if rates is not None:  # (None: the compiled pass does not run here)
                        host_expert_factors[dtype] = rates.alone
                        if rates.worker:
                            host_experts_on_worker[dtype] = rates.worker
                            worker_teams[dtype] = rates.teams
            zero_copy = vram_decode = fill_issue = None
            if use_gpu:
                _measure_gpu(spec, top, w, cpu_args, gpu_args, progress, matmul, attention, transfer, dispatch)
                try:  # (an optional table: a failure here costs it, not the profile's minutes)
                    zero_copy = measure_zero_copy(budget_s=max(spec.gpu_point_budget_s, 0.05), progress=progress,
                                                  weight=w["transfer"])
                except Exception as exc:  # (Triton compile errors are not RuntimeErrors)
                    log.warning("the GPU's zero-copy expert reads were not measured (%s); the planner takes "
                                "its default share of the copy engine for them", exc)
                try:
                    vram_decode = measure_vram_decode(budget_s=max(spec.gpu_point_budget_s, 0.05), progress=progress,
                                                      weight=w["transfer"])
                except Exception as exc:
                    log.warning("the GPU's decode of coded weights was not measured (%s); the planner prices it "
                                "from the GPU's one-row read", exc)
                try:
                    fill_issue = measure_fill_issue(budget_s=DISPATCH_BUDGET_S, progress=progress,
                                                    weight=w["dispatch"])
                except Exception as exc:
                    log.warning("the host's cost of issuing a coded fill was not measured (%s); the planner takes "
                                "the fifty-fifth GPU session's H100 figures", exc)
            for round_ in range(2, spec.cpu_rounds + 1):
                _cpu_round(spec, top, round_, cpu_args, matmul, attention)
            reads.append(measure_cpu_read(READ_BUDGET_S))  # the host's state over the whole profile

    elapsed = time.perf_counter() - started
    fingerprint = machine_fingerprint()
    data = {
        "schema": SCHEMA, "version": VERSION, "vramshard_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "fingerprint": fingerprint, "fingerprint_hash": fingerprint_hash(fingerprint),
        "quick": spec.quick, "synthetic": False, "elapsed_s": round(elapsed, 2),
        "cpu": {"threads": threads, "default_threads": top, "read_gb_s": round(sum(reads) / len(reads) / 1e9, 2),
                "gather_gb_s": round(gather / 1e9, 2)},
        "matmul": matmul, "transfer": transfer, "attention": attention, "dispatch": dispatch,
        "elapsed_by_table_s": clock.finish(),
    }
    beside = clock.beside()
    if beside is not None:
        data["host_beside"] = {**beside, "retimed_points": steal_guard.retimed, "stolen_points": steal_guard.stolen}
        if steal_guard.retimed:
            log.info("%d CPU timings taken again after the virtual machine's host stole their CPUs (%d still under "
                     "steal after theirs)", steal_guard.retimed, steal_guard.stolen)
    if cpu_gemv.computes(1):  # its one-row CPU products went through the C kernel (layers/cpu_gemv.py)
        data["cpu_gemv"] = cpu_gemv.isa()
    if split_part:
        data["split_part"] = split_part
    if packed_ffn:
        data["packed_ffn"] = packed_ffn
    if tiles_ffn:
        data["tiles_ffn"] = tiles_ffn
    if host_expert_factors:
        data["host_experts"] = host_expert_factors
        if cpu_gemv.computes(1):  # (the same switch and build: routed experts went through it too)
            data["host_experts_cpu_gemv"] = cpu_gemv.isa()
    if zero_copy is not None:
        data["zero_copy"] = zero_copy
    if vram_decode is not None:
        data["vram_decode"] = vram_decode
    if fill_issue is not None:
        data["fill_issue"] = fill_issue
    if host_experts_on_worker:
        data["host_experts_worker"] = host_experts_on_worker
        data["host_experts_worker_teams"] = worker_teams
        data["host_experts_worker_beside"] = "launches"  # (time_cpu_beside_python's host thread)
    estimated = sum(t.get("estimated", 0) for t in matmul + attention)
    log.info("profile measured in %.1f s (%d points extrapolated beyond the time cap)", elapsed, estimated)
    return Profile(data)


def _cpu_round(spec: BenchmarkSpec, top: int, round_: int, cpu_args: dict, matmul: list[dict],
               attention: list[dict]) -> None:
    """Measure the all-cores CPU tables again; each point keeps the faster of its rounds."""
    for table in matmul:
        if table["device"] == "cpu" and table["threads"] == top and not table["contended"]:
            again = measure_matmul("cpu", table["dtype"], table["shapes"], table["m"],
                                   label=f"cpu matmul {table['dtype']} threads={top} round {round_}", **cpu_args)
            _keep_fastest(table, again)
    for table in attention:
        if table["device"] == "cpu":
            again = measure_attention("cpu", table["dtype"], table["heads"], table["kv_heads"], table["head_dim"],
                                      table["n_new"], table["context"],
                                      label=f"cpu attention {table['dtype']} round {round_}", **cpu_args)
            _keep_fastest(table, again)


def _keep_fastest(table: dict, again: dict) -> None:
    """``table``'s seconds, point by point, as the faster of it and ``again`` (the same grid)."""
    table["seconds"] = [[min(a, b) for a, b in zip(row, other)] for row, other in zip(table["seconds"], again["seconds"])]
    table["estimated"] = min(table.get("estimated", 0), again.get("estimated", 0))


def _measure_gpu(spec, top, w, cpu_args, gpu_args, progress, matmul, attention, transfer, dispatch) -> None:
    """GPU matmul, attention, dispatch, PCIe alone and contended (CPU threads = ``top``)."""
    progress.step("cuda dispatch cost")
    dispatch["cuda"] = measure_dispatch("cuda", DISPATCH_BUDGET_S)
    dispatch.update(measure_graph_replay(DISPATCH_BUDGET_S / 2))
    progress.advance(w["dispatch"])
    for dtype in spec.dtypes:
        table = measure_matmul("cuda", dtype, spec.shapes, spec.ms, label=f"cuda matmul {dtype}", **gpu_args)
        matmul.append({"device": "cuda", "dtype": dtype, "threads": None, "contended": False, **table})
        for heads, kv_heads, head_dim in spec.attention_heads:
            table = measure_attention("cuda", dtype, heads, kv_heads, head_dim, spec.attention_n_new,
                                      spec.attention_context, label=f"cuda attention {dtype}", **gpu_args)
            attention.append({"device": "cuda", "dtype": dtype, "threads": None, **table})
    torch.cuda.empty_cache()
    transfer_args = {"budget_s": max(spec.gpu_point_budget_s, 0.02), "progress": progress, "weight": w["transfer"]}
    directions = ("h2d", "d2h")
    alone = {d: measure_transfers(spec.transfer_sizes, d, label=f"{d} pinned", **transfer_args) for d in directions}
    with cpu_load() as cpu_reading:
        contended = {d: measure_transfers(spec.transfer_sizes, d, label=f"{d} pinned, CPU busy", **transfer_args)
                     for d in directions}
    for d in directions:  # what the CPU read meanwhile
        contended[d]["load_cpu_gbps"] = round(cpu_reading.gbps, 2)
    log.info("PCIe copies timed beside the CPU reading %.1f GB/s of weights", cpu_reading.gbps)
    for d in directions:  # alone once more, after: each size's faster copy kept (bench_transfer.faster_of)
        alone[d] = faster_of(alone[d], measure_transfers(spec.transfer_sizes, d, label=f"{d} pinned, again",
                                                         **transfer_args))
    transfer.extend({"direction": d, "contended": False, **alone[d]} for d in directions)
    transfer.extend({"direction": d, "contended": True, **contended[d]} for d in directions)
    torch.cuda.empty_cache()
    if spec.cpu_contention:
        contended = []
        with pcie_load(64 * 2**20 if spec.quick else 256 * 2**20) as load:
            for dtype in spec.dtypes:
                table = measure_matmul("cpu", dtype, spec.ratio_shapes, spec.ratio_ms,
                                       label=f"cpu matmul {dtype} threads={top} +PCIe", **cpu_args)
                contended.append({"device": "cpu", "dtype": dtype, "threads": top, "contended": True, **table})
        for table in contended:  # the host→device rate the copy engine kept up meanwhile
            table["load_h2d_gbps"] = round(load.gbps, 2)
        matmul.extend(contended)
        log.info("CPU matmuls timed beside %.1f GB/s of host-to-device copies", load.gbps)
