"""``vramshard profile``: measure this machine once and store the profile file.

    vramshard profile                 # full profile (minutes), saved in the cache directory
    vramshard profile --quick         # coarse profile (about a minute)
    vramshard profile --show          # summary of the stored profile (measures if there is none)
    vramshard profile --threads 1,4,8 # CPU thread counts to measure (the largest = "all cores")
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from ..errors import InvalidInputError


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "profile", help="measure this machine's CPU, GPU and PCIe speeds for the planner",
        description="Measure this machine's CPU, GPU and PCIe speeds and store them for the planner.",
    )
    parser.add_argument("--quick", action="store_true", help="coarse profile: fewer shapes and sizes, all cores only (about a minute)")
    parser.add_argument("--out", metavar="PATH", help="write the profile here instead of the cache directory")
    parser.add_argument("--show", action="store_true",
                        help="print a summary; without --quick/--threads shows the stored profile if there is one")
    parser.add_argument("--threads", metavar="LIST", help="CPU thread counts to measure, e.g. 1,2,4,8 (default: powers of two up to all cores)")
    parser.add_argument("--no-gpu", action="store_true", help="measure the CPU only, even if CUDA is available")
    parser.set_defaults(func=main)


def _parse_threads(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        counts = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise InvalidInputError(f"--threads must be a comma-separated list of integers, got {text!r}") from None
    if not counts or counts[0] < 1:
        raise InvalidInputError(f"--threads needs positive thread counts, got {text!r}")
    return counts


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ..profile import store
    from ..profile.spec import BenchmarkSpec

    console = Console()
    threads = _parse_threads(args.threads)
    target = Path(args.out) if args.out else None
    if args.show and not args.quick and threads is None:
        existing = target or store.profile_path()
        if existing.exists():
            profile = store.load(existing, check_fingerprint=target is None)
            print_summary(console, profile, existing)
            return 0

    from ..profile.progress import TableClock
    from ..profile.runner import run_profile

    overrides = {"threads": threads}
    if args.no_gpu:
        overrides["gpu"] = False
    spec = BenchmarkSpec.quick_spec(**overrides) if args.quick else BenchmarkSpec.full(**overrides)
    if console.is_terminal:
        with _RichProgress(console) as progress:
            profile = run_profile(spec, progress)
    else:  # (a log, a pipe: a bar draws nothing there) the profiler's line for each table it starts, so that a
        # profile cut short still shows how far it got
        logging.getLogger(TableClock.__module__).setLevel(logging.INFO)
        profile = run_profile(spec)
    path = store.save(profile, target)
    size = path.stat().st_size
    console.print(f"profile written to [bold]{path}[/bold] ({size / 1024:.0f} KiB, "
                  f"measured in {profile.data['elapsed_s']:.0f} s)")
    if args.show:
        print_summary(console, profile, path)
    return 0


class _RichProgress:
    """A rich progress bar fed by the profiler's ProgressSink calls."""

    def __init__(self, console):
        from rich.progress import (BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        self._progress = Progress(
            TextColumn("{task.description}", style="cyan"), BarColumn(), TaskProgressColumn(),
            TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(), console=console, transient=True,
        )
        self._task = None

    def __enter__(self):
        self._progress.__enter__()
        return self

    def __exit__(self, *exc):
        return self._progress.__exit__(*exc)

    def start(self, total_weight: float) -> None:
        self._task = self._progress.add_task("profiling", total=total_weight)

    def step(self, label: str) -> None:
        self._progress.update(self._task, description=f"{label:<52}")

    def advance(self, weight: float) -> None:
        self._progress.advance(self._task, weight)


def print_summary(console, profile, path) -> None:
    """A readable summary of a profile: peaks, PCIe, dispatch cost."""
    from rich.table import Table

    summary = profile.summary()
    data = profile.data
    fp = data["fingerprint"]
    console.print(f"[bold]profile[/bold] {path}")
    console.print(f"  measured {data['created']}{' (quick)' if data.get('quick') else ''} in {data.get('elapsed_s', 0):.0f} s; "
                  f"CPU {fp.get('cpu_model')} ({fp.get('cpu_count')} CPUs, {fp.get('memory_gib')} GiB), "
                  f"GPU {fp.get('gpu_name') or 'none'}, torch {fp.get('torch')}")
    console.print(f"  CPU threads measured: {summary['cpu_threads']} (default {summary['default_threads']})")
    if summary.get("cpu_read_gb_s"):
        console.print(f"  host memory read, all cores: {summary['cpu_read_gb_s']:.1f} GB/s")
    if summary.get("cpu_gather_gb_s"):
        console.print(f"  KV blocks gathered into pinned memory, all cores: {summary['cpu_gather_gb_s']:.1f} GB/s")
    console.print("  one-row CPU products timed through " + (f"the C kernel ({profile.cpu_gemv})" if profile.cpu_gemv
                                                              else "torch's paths"))
    slowest = sorted(data.get("elapsed_by_table_s", {}).items(), key=lambda item: -item[1])[:5]
    if slowest:
        console.print("  slowest tables: " + ", ".join(f"{table} {seconds:.0f} s" for table, seconds in slowest))
    beside = data.get("host_beside")
    if beside:
        busiest = max(beside["by_table"].items(), key=lambda item: item[1]["others_cores"], default=None)
        console.print(f"  other work on the CPUs meanwhile: {beside['others_cores']:.2f} cores on average, "
                      f"{beside['steal_cores']:.2f} of them stolen by the virtual machine's host"
                      + (f" (the profile's own threads: {beside['own_cores']:.2f})" if "own_cores" in beside else "")
                      + (f"; {beside['retimed_points']} CPU timings taken again under steal"
                         if beside.get("retimed_points") else "")
                      + (f"; most beside {busiest[0]} ({busiest[1]['others_cores']:.2f} cores, "
                         f"{busiest[1]['steal_cores']:.2f} stolen)" if busiest else ""))
    peaks = Table(title="peak matmul GFLOP/s")
    peaks.add_column("device")
    dtypes = sorted({d for per in summary["matmul_peak_gflops"].values() for d in per})
    for dtype in dtypes:
        peaks.add_column(dtype, justify="right")
    for device, per in summary["matmul_peak_gflops"].items():
        peaks.add_row(device, *[f"{per[d]:,.0f}" if d in per else "-" for d in dtypes])
    console.print(peaks)
    if summary["transfer_gbps"]:
        pcie = Table(title="PCIe GB/s (pinned)")
        for column in ("direction", "alone", "CPU busy", "CPU read meanwhile"):
            pcie.add_column(column, justify="right")
        for direction, per in summary["transfer_gbps"].items():
            beside = per.get("cpu_read_beside")
            pcie.add_row(direction, f"{per.get('alone', 0):.1f}", f"{per.get('contended', 0):.1f}",
                         f"{beside:.1f}" if beside else "-")
        console.print(pcie)
    else:
        console.print("  no GPU: CPU-only profile")
    if summary.get("zero_copy_gb_s"):
        reads = summary["zero_copy_gb_s"]
        console.print(f"  routed experts read by the GPU's kernels from pinned host memory: {reads['kernels']:.1f} GB/s, "
                      f"{reads['kernels'] / reads['copy_engine']:.0%} of the copy engine's {reads['copy_engine']:.1f}")
    if summary.get("vram_decode_gb_s"):
        console.print(f"  coded weights decoded in VRAM at {summary['vram_decode_gb_s']:.0f} GB/s of raw bytes "
                      "(pinned weights kept coded: VRAMSHARD_VRAM_CODEC)")
    if summary.get("fill_issue_us"):
        issue = summary["fill_issue_us"]
        console.print(f"  a coded stream fill costs the host {issue['graph']:.1f} µs + {issue['graph_round']:.1f} µs a "
                      f"round from its CUDA graph, {issue['round']:.1f} µs a round issued round by round")
    eager = {device: us for device, us in summary["dispatch_us"].items() if not device.startswith("cuda_graph")}
    dispatch = ", ".join(f"{device} {us:.1f} µs" for device, us in eager.items())
    console.print(f"  dispatch cost per sub-layer: {dispatch}")
    if "cuda_graph" in summary["dispatch_us"]:
        graph = summary["dispatch_us"]
        console.print(f"  the same kernels replayed from a CUDA graph: {graph['cuda_graph']:.1f} µs of host time "
                      f"(+{graph.get('cuda_graph_node', 0.0) * 1e3:.1f} ns a kernel more)")
    if summary["split_part_factor"]:
        factors = ", ".join(f"{dtype} {f:.2f}x" for dtype, f in summary["split_part_factor"].items())
        console.print(f"  split FFN, CPU part's time per byte over the whole FFN's: {factors}")
    experts_by = f"C kernel ({profile.host_experts_cpu_gemv})" if profile.host_experts_cpu_gemv else "compiled pass"
    for key, what, unit in (("packed_ffn_factor", "dense FFN on the CPU, oneDNN-prepacked over plain", "x"),
                            ("tiles_ffn_factor", "dense FFN on the CPU, the C kernel's matrix tiles over torch", "x"),
                            ("host_experts_gb_s", f"MoE experts on the CPU, {experts_by}", " GB/s"),
                            ("host_experts_worker_gb_s", "the same on the run-ahead worker beside the host thread"
                             if profile.worker_rates_measured else
                             "the same on the run-ahead worker beside Python alone (not used)", " GB/s")):
        if summary.get(key):
            values = "; ".join(f"{dtype} " + ", ".join(f"{rows} rows {float(v):.2f}{unit}" for rows, v in by_rows.items())
                               for dtype, by_rows in summary[key].items())
            console.print(f"  {what}: {values}")
    if summary.get("host_experts_worker_teams_gb_s"):
        values = "; ".join(f"{dtype} " + ", ".join(f"{team} threads {float(v):.2f} GB/s" for team, v in by_team.items())
                           for dtype, by_team in summary["host_experts_worker_teams_gb_s"].items())
        team = profile.worker_team("bf16")
        console.print(f"  one token on the run-ahead worker, by its team: {values}; " +
                      (f"the worker computes with {team} threads" if team else
                       "timed beside Python alone (before session 39), so not used: the worker computes with "
                       "one core fewer than the process"))
    _print_fitted(console, profile)


def _print_fitted(console, profile) -> None:
    """The factors engines fitted to their own steps on this profile (profile/learned.py), if any."""
    from ..profile import learned

    data = profile.data
    if data.get("synthetic") or not data.get("fingerprint_hash"):
        return
    kept = learned.read_all(data["fingerprint_hash"], str(data.get("created")))
    for dtype, (rows, dispatch, split) in kept.items():
        by_rows = ", ".join(f"{r} rows {f:.2f}x" for r, f in rows) or "none"
        split_by_rows = ", ".join(f"{r} rows {f:.2f}x" for r, f in split) or "none"
        console.print(f"  fitted by the engine ({dtype}): CPU compute by rows {by_rows}; split FFN CPU parts "
                      f"by rows {split_by_rows} on top; GPU dispatch {dispatch:.2f}x")
    if kept:
        console.print(f"  (from {learned.path(data['fingerprint_hash'])}; delete it to start from the profile alone)")
