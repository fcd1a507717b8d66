"""Check the profiler on this machine: duration, repeatability, interpolation error.

Runs the full profile twice, reports each run's wall time, the percent difference of the
main figures (peak GFLOP/s per device and dtype, H2D/D2H GB/s alone and under CPU load,
dispatch µs) between the runs, and the percent error of interpolated predictions against
direct measurements for matmul shapes (and transfer sizes, attention sizes) the profile
did not measure (the CPU's direct times in two rounds, each point keeping its faster, as the
full profile's CPU tables do). Prints a summary and writes JSON.

The host CPU of the GPU machine drifts by more than the 20% the check allows, within one process
(seventeenth GPU session: the same matmul 15-34% apart minutes later), so a CPU point's error
against the profile mixes the machine's drift since the profile with the interpolation's own
error. Each CPU point is therefore also timed beside a reference: the nearest point the profile
measured (:func:`matmul_reference`, :func:`attention_reference`), timed right after it in the same
round. The prediction scaled by that reference's direct time over its table time is the
*drift-corrected* prediction; its error is the interpolation's, apart from the two timings' noise.
Both errors are reported. Each probe and each run also says what else ran on the CPUs meanwhile (other
processes' cores and a virtual machine's steal, ``/proc/stat``); the held-out CPU points are timed again
where steal took a quarter of a core or more over them (``timing.StealGuard``, as the profile's own).

    python benchmarks/profile_check.py [--out PATH] [--quick] [--second-quick] [--budget-s 540]
                                       [--against PROFILE.json]

The whole check is meant to fit in ~9 minutes on a 16-core + H200 machine: if the first
full run takes more than half the budget, the second run is a ``--quick`` profile (this is
said in the output and in the JSON as ``second_run_quick``). Two full runs do not fit one
10-minute call there (309 s each in the fifteenth GPU session), so ``--against`` takes the
first run's file of an earlier call (``profile_run1.json``, which every check writes beside
its report) as run 1 and measures one full profile as run 2; the file must be of a machine
with this one's fingerprint (CPU, cores, memory, GPU, driver, torch).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from vramshard.profile import BenchmarkSpec, load, save
from vramshard.profile.bench_attention import cold_kv_ring, cycling_cache_reads, sdpa_gqa
from vramshard.profile.bench_matmul import cold_copies, linear_over
from vramshard.profile.runner import run_profile
from vramshard.profile.spec import torch_dtype
from vramshard.profile.timing import StealGuard, time_cpu, time_cuda
from vramshard.runtime.host_load import OtherLoad

# (M, K, N): none of these (K, N) is in the full grid except where noted; M 3, 48 and 1536 are off
# its M grid (powers of two), the others on it.
HELD_OUT_MATMUL = [
    (3, 4096, 6144),
    (8, 3072, 9216),
    (32, 5120, 13824),
    (48, 14336, 4096),  # measured shape, unmeasured M
    (128, 2048, 5632),
    (512, 3072, 3072),
    (1536, 4096, 11008),
]
# Points the full profile measures (shape and M both on its grid): a direct timing of these says
# how far the table and a direct run disagree at all, apart from any interpolation.
GRID_POINTS = [(1, 4096, 14336), (64, 4096, 14336), (16, 14336, 4096)]
HELD_OUT_TRANSFER = [3 * 2**20, 100 * 2**20, 384 * 2**20]
HELD_OUT_ATTENTION = [(8, 3000), (64, 12000), (512, 1500)]  # (n_new, context), 32 heads, 8 kv, 128 dim


# CPU points re-timed before, between and after the runs: how far the machine itself drifts over the
# check (on the shared H200 host CPU figures moved 6-31% between two runs minutes apart).
DRIFT_PROBES = [(1, 4096, 14336, "bf16"), (64, 4096, 14336, "bf16"), (1, 4096, 14336, "fp32"), (64, 4096, 14336, "fp32")]


def cpu_probe(when: str) -> dict:
    """Seconds of the DRIFT_PROBES matmuls on the CPU now (cold weights, as the profile times them), and the
    cores other processes kept busy meanwhile with the steal among them (None where /proc cannot say)."""
    times = {}
    load = OtherLoad()
    load.cores()  # (starts the count)
    with torch.inference_mode():
        for m, k, n, dtype in DRIFT_PROBES:
            dt = torch_dtype(dtype)
            weights = cold_copies(torch.randn(n, k, dtype=dt))
            times[f"{dtype} {m}x{k}x{n}"] = time_cpu(linear_over(torch.randn(m, k, dtype=dt), weights), 0.3)
            del weights
    others = load.cores()
    beside = ({"others_cores": others, "steal_cores": load.steal, "own_cores": load.own} if others is not None
              else None)
    print(f"cpu probe {when}: " + ", ".join(f"{key} {t * 1e3:.2f} ms" for key, t in times.items())
          + (f" (other work {others:.2f} cores, {load.steal:.2f} stolen; the probe's {load.own:.2f})"
             if others is not None else ""), flush=True)
    return {"when": when, "seconds": times, "beside": beside}


def beside_line(name: str, profile) -> str:
    """What ran on the CPUs beside a profile's measurement (``host_beside``, since 2026-12-07), as one line."""
    beside = profile.data.get("host_beside")
    if not beside:
        return f"{name}: not recorded"
    busiest = sorted(beside["by_table"].items(), key=lambda item: -item[1]["others_cores"])[:3]
    return (f"{name}: {beside['others_cores']:.2f} cores busy with other work, {beside['steal_cores']:.2f} stolen, "
            f"{beside.get('own_cores', float('nan')):.2f} with the profile's, {beside.get('retimed_points', 0)} CPU "
            f"timings taken again under steal; "
            "most beside " + ", ".join(f"{table} ({row['others_cores']:.2f}, {row['steal_cores']:.2f} stolen)"
                                       for table, row in busiest))


def drift(probes: list[dict]) -> list[dict]:
    """Each probe's times as percent differences from the first probe's."""
    first = probes[0]["seconds"]
    return [{"when": p["when"], "pct": {key: pct(first[key], t) for key, t in p["seconds"].items()}} for p in probes]


def pct(a: float, b: float) -> float:
    """Percent difference of ``b`` from ``a``."""
    return 100.0 * (b - a) / a if a else float("nan")


def compare(first: dict, second: dict) -> dict:
    """Percent differences of the main figures of two profile summaries."""
    out: dict[str, float] = {}
    for device, per in first["matmul_peak_gflops"].items():
        for dtype, value in per.items():
            other = second["matmul_peak_gflops"].get(device, {}).get(dtype)
            if other is not None:
                out[f"peak GFLOP/s {device} {dtype}"] = pct(value, other)
    for direction, per in first["transfer_gbps"].items():
        for case, value in per.items():
            other = second["transfer_gbps"].get(direction, {}).get(case)
            if other is not None:
                out[f"{direction} GB/s {case}"] = pct(value, other)
    for device, value in first["dispatch_us"].items():
        if device in second["dispatch_us"]:
            out[f"dispatch us {device}"] = pct(value, second["dispatch_us"][device])
    for dtype, value in first.get("split_part_factor", {}).items():
        if dtype in second.get("split_part_factor", {}):
            out[f"split FFN part factor {dtype}"] = pct(value, second["split_part_factor"][dtype])
    for key, what, counted in (("host_experts_gb_s", "CPU experts pass", "rows"),
                               ("host_experts_worker_gb_s", "CPU experts pass on the worker", "rows"),
                               ("host_experts_worker_teams_gb_s", "CPU experts pass on the worker, 1 row", "threads")):
        for dtype, by_rows in first.get(key, {}).items():
            for rows, value in by_rows.items():
                other = second.get(key, {}).get(dtype, {}).get(rows)
                if other is not None:  # (a quick second run times fewer rows)
                    out[f"{what} GB/s {dtype} {rows} {counted}"] = pct(value, other)
    if first.get("cpu_read_gb_s") and second.get("cpu_read_gb_s"):  # (profiles since 2026-12-04)
        out["host memory read GB/s"] = pct(first["cpu_read_gb_s"], second["cpu_read_gb_s"])
    return out


def _nearest(value: float, choices) -> float:
    """The choice nearest ``value`` on a log scale (the smaller one on a tie)."""
    return min(choices, key=lambda c: (abs(math.log(c / value)), c))


def matmul_reference(profile, m: int, k: int, n: int, dtype: str, device: str) -> tuple[int, int, int]:
    """The measured point whose drift since the profile corrects ``(m, k, n)``'s prediction: the
    profile's M nearest ``m``, and its ``(K, N)`` nearest ``k·n`` in weight count other than ``(k, n)``
    itself (a grid point must not be its own reference)."""
    shapes, ms = profile.matmul_grid(dtype, device)
    others = [s for s in shapes if tuple(s) != (k, n)] or shapes
    by_work = {s[0] * s[1]: s for s in sorted(others, reverse=True)}  # equal K·N: the smaller K wins
    k_ref, n_ref = by_work[_nearest(k * n, by_work)]
    return int(_nearest(m, ms)), k_ref, n_ref


def attention_reference(profile, n_new: int, context: int, dtype: str, device: str) -> tuple[int, int]:
    """The measured (new tokens, context) of the 32/8/128 layout nearest ``(n_new, context)``."""
    news, contexts = profile.attention_grid(dtype, device, 32, 8, 128)
    return int(_nearest(n_new, news)), int(_nearest(context, contexts))


def drift_corrected(row: dict) -> None:
    """Add the prediction scaled by the reference's direct over table time, and its error."""
    scale = row["reference_direct_s"] / row["reference_table_s"]
    row["drift_corrected_predicted_s"] = row["predicted_s"] * scale
    row["drift_corrected_error_pct"] = pct(row["direct_s"], row["drift_corrected_predicted_s"])


def held_out(profile, cpu_rounds: int = 2) -> list[dict]:
    """Direct measurement vs interpolated prediction for shapes the profile did not measure. The
    CPU points are measured in ``cpu_rounds`` rounds, one after the other, each keeping its fastest
    (as the profile's own CPU tables do): one round can meet a slow spell of a shared host. Each CPU
    point's reference (see the module docstring) is timed beside it and keeps its fastest too."""
    rows = _held_out_on("cpu", profile)
    for _ in range(cpu_rounds - 1):
        for row, again in zip(rows, _held_out_on("cpu", profile)):
            row["direct_s"] = min(row["direct_s"], again["direct_s"])
            row["reference_direct_s"] = min(row["reference_direct_s"], again["reference_direct_s"])
            row["error_pct"] = pct(row["direct_s"], row["predicted_s"])
    for row in rows:
        drift_corrected(row)
    if profile.has_gpu:
        rows += _held_out_on("cuda", profile) + _held_out_transfers(profile)
    return rows


# The held-out CPU points timed again where the virtual machine's host stole the CPUs, as the profile's own are.
HELD_OUT_GUARD = StealGuard(OtherLoad())


def time_matmul(m: int, k: int, n: int, dtype: str, device: str) -> float:
    """Seconds of one ``[m, k] @ [k, n]`` projection, cold weights as the profile measures them
    (and as a model reads them)."""
    dt = torch_dtype(dtype)
    with torch.inference_mode():
        x = torch.randn(m, k, dtype=dt, device=device)
        weights = cold_copies(torch.randn(n, k, dtype=dt, device=device))
        fn = linear_over(x, weights)
        return time_cuda(fn, 0.05) if device == "cuda" else HELD_OUT_GUARD.time(fn, 0.2)


def time_attention(n_new: int, context: int, dtype: str, device: str) -> float:
    """Seconds of attention of ``n_new`` tokens over ``context`` (32 heads, 8 KV heads, 128 dims), the
    profile's way: on the CPU over cold copies of a cache in the executor's layout."""
    dt = torch_dtype(dtype)
    with torch.inference_mode():
        q = torch.randn(1, 32, n_new, 128, dtype=dt, device=device)
        if device == "cpu":
            ring = cold_kv_ring(8 * 128 * context, dt)
            return HELD_OUT_GUARD.time(cycling_cache_reads(q, ring, 8, context, 128), 0.2)
        k = torch.randn(1, 8, context, 128, dtype=dt, device=device)
        v = torch.randn(1, 8, context, 128, dtype=dt, device=device)  # apart from k, as the profile
        return time_cuda(lambda: sdpa_gqa(q, k, v), 0.05)


def _held_out_on(device: str, profile) -> list[dict]:
    """One round of the held-out matmul and attention points on ``device``; on the CPU each point's
    reference is timed right after it."""
    rows = []
    for dtype in ("bf16", "fp16", "fp32"):
        for m, k, n in HELD_OUT_MATMUL + GRID_POINTS:
            direct = time_matmul(m, k, n, dtype, device)
            predicted = profile.matmul_s(m, k, n, dtype, device)
            kind = "matmul-grid" if (m, k, n) in GRID_POINTS else "matmul"
            row = {"kind": kind, "device": device, "dtype": dtype, "shape": [m, k, n],
                   "direct_s": direct, "predicted_s": predicted, "error_pct": pct(direct, predicted)}
            if device == "cpu":
                reference = matmul_reference(profile, m, k, n, dtype, device)
                row.update(reference=list(reference), reference_direct_s=time_matmul(*reference, dtype, device),
                           reference_table_s=profile.matmul_s(*reference, dtype, device))
            rows.append(row)
        for n_new, context in HELD_OUT_ATTENTION:
            direct = time_attention(n_new, context, dtype, device)
            predicted = profile.attention_s(n_new, context, 32, 8, 128, dtype, device)
            row = {"kind": "attention", "device": device, "dtype": dtype, "shape": [n_new, context],
                   "direct_s": direct, "predicted_s": predicted, "error_pct": pct(direct, predicted)}
            if device == "cpu":
                reference = attention_reference(profile, n_new, context, dtype, device)
                row.update(reference=list(reference), reference_direct_s=time_attention(*reference, dtype, device),
                           reference_table_s=profile.attention_s(*reference, 32, 8, 128, dtype, device))
            rows.append(row)
    return rows


def _held_out_transfers(profile) -> list[dict]:
    """The held-out transfer sizes, both ways over PCIe."""
    rows = []
    host = torch.empty(max(HELD_OUT_TRANSFER), dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(max(HELD_OUT_TRANSFER), dtype=torch.uint8, device="cuda")
    for size in HELD_OUT_TRANSFER:
        for direction in ("h2d", "d2h"):
            src, dst = (host[:size], dev[:size]) if direction == "h2d" else (dev[:size], host[:size])
            direct = time_cuda(lambda: dst.copy_(src, non_blocking=True), 0.1)
            predicted = profile.transfer_s(size, direction)
            rows.append({"kind": "transfer", "device": direction, "dtype": "-", "shape": [size],
                         "direct_s": direct, "predicted_s": predicted, "error_pct": pct(direct, predicted)})
    return rows


def within_20(rows: list[dict], key: str = "error_pct") -> dict[str, tuple[int, int]]:
    """(points within 20%, points) per kind, device and dtype, by ``key`` (a drift-corrected error
    where a row has one, else its plain error)."""
    out: dict[str, list[int]] = {}
    for r in rows:
        group = out.setdefault(f"{r['kind']} {r['device']} {r['dtype']}", [0, 0])
        group[0] += abs(r.get(key, r["error_pct"])) <= 20
        group[1] += 1
    return {k: (hit, total) for k, (hit, total) in out.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_out = os.path.join(os.environ["OUT"], "profile_check.json") if os.environ.get("OUT") else "profile_check.json"
    parser.add_argument("--out", default=default_out, help=f"JSON report path (default {default_out})")
    parser.add_argument("--quick", action="store_true", help="both runs quick (for a smoke test)")
    parser.add_argument("--second-quick", action="store_true", help="second run quick (to fit the time budget)")
    parser.add_argument("--budget-s", type=float, default=540.0, help="total time to stay under (default 540)")
    parser.add_argument("--against", default=None, metavar="PROFILE",
                        help="run 1 is this saved profile of this machine (an earlier call's profile_run1.json); "
                             "one full profile is measured as run 2")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if args.against:
        first = load(args.against)  # ProfileError: missing, corrupt, or another machine's (before any run)
        profile_file, elapsed_1 = Path(args.against), None
        probes = [cpu_probe("before run 2")]
        print(f"run 1: {args.against} (measured {first.data.get('created', '?')})", flush=True)
    else:
        probes = [cpu_probe("before run 1")]
        make = BenchmarkSpec.quick_spec if args.quick else BenchmarkSpec.full
        print(f"run 1: {'quick' if args.quick else 'full'} profile ...", flush=True)
        t0 = time.perf_counter()
        first = run_profile(make())
        elapsed_1 = time.perf_counter() - t0
        print(f"run 1: {elapsed_1:.1f} s", flush=True)
        profile_file = save(first, out_path.with_name("profile_run1.json"))  # now: it outlives a check cut short
        probes.append(cpu_probe("after run 1"))
    make = BenchmarkSpec.quick_spec if args.quick else BenchmarkSpec.full
    second_quick = args.quick or args.second_quick or (elapsed_1 is not None and elapsed_1 > args.budget_s / 2 - 30)
    if second_quick and not args.quick:
        print(f"run 2: quick profile (first run took {elapsed_1:.0f} s; two full runs would exceed the "
              f"{args.budget_s:.0f} s budget or --second-quick was given)", flush=True)
    else:
        print("run 2: same profile ...", flush=True)
    t0 = time.perf_counter()
    second = run_profile(BenchmarkSpec.quick_spec() if second_quick else make())
    elapsed_2 = time.perf_counter() - t0
    print(f"run 2: {elapsed_2:.1f} s", flush=True)
    probes.append(cpu_probe("after run 2"))

    summary_1, summary_2 = first.summary(), second.summary()
    differences = compare(summary_1, summary_2)
    # Held-out shapes against the latest full profile: the one measured just before them, so the
    # error is the interpolation's, not the machine's drift between the runs (which `compare` shows).
    latest = first if second_quick else second
    print(f"held-out shapes: direct vs interpolated from run {1 if second_quick else 2} ...", flush=True)
    rows = held_out(latest)
    probes.append(cpu_probe("after the held-out shapes"))

    if not second_quick:
        save(second, out_path.with_name("profile_run2.json"))
    report = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu only",
        "cpu_threads": torch.get_num_threads(),
        "fingerprint": first.data["fingerprint"],
        "run1_elapsed_s": elapsed_1, "run1_file": args.against, "run2_elapsed_s": elapsed_2,
        "second_run_quick": second_quick,
        "run1_quick": args.quick, "profile_file_bytes": profile_file.stat().st_size,
        "run1_summary": summary_1, "run2_summary": summary_2, "difference_pct": differences,
        "held_out_profile": "run 1" if second_quick else "run 2", "held_out": rows, "held_out_cpu_rounds": 2,
        "held_out_max_abs_error_pct": {
            kind: max((abs(r["error_pct"]) for r in rows if r["kind"] == kind), default=None)
            for kind in ("matmul", "attention", "transfer")
        },
        "held_out_within_20pct": within_20(rows),
        "held_out_within_20pct_drift_corrected": within_20(rows, "drift_corrected_error_pct"),
        "cpu_probes": probes, "cpu_drift_pct": drift(probes),
        "total_elapsed_s": time.perf_counter() - started,
        "run2_elapsed_by_table_s": latest.data.get("elapsed_by_table_s", {}),
        "host_beside": {"run1": first.data.get("host_beside"), "run2": second.data.get("host_beside")},
        "held_out_retimed_under_steal": HELD_OUT_GUARD.retimed, "held_out_still_stolen": HELD_OUT_GUARD.stolen,
    }
    out_path.write_text(json.dumps(report, indent=1))

    run_1 = f"{elapsed_1:.1f} s" if elapsed_1 is not None else f"{args.against} (saved)"
    print(f"\nprofile runs: {run_1} and {elapsed_2:.1f} s"
          f"{' (second quick)' if second_quick and not args.quick else ''}; file {report['profile_file_bytes'] / 1024:.0f} KiB")
    slowest = sorted(report["run2_elapsed_by_table_s"].items(), key=lambda item: -item[1])[:8]
    if slowest:
        print("where the last run's time went (s): " + ", ".join(f"{table} {seconds:.0f}" for table, seconds in slowest))
    print("other work on the CPUs while each run measured: " + "; ".join(
        beside_line(name, profile) for name, profile in (("run 1", first), ("run 2", second))))
    print("main figures: run 1 | run 2 | difference")
    for device, per in summary_1["matmul_peak_gflops"].items():
        for dtype, value in per.items():
            other = summary_2["matmul_peak_gflops"].get(device, {}).get(dtype, float("nan"))
            print(f"  peak {device:4s} {dtype}: {value:10.0f} | {other:10.0f} GFLOP/s | {pct(value, other):+6.1f}%")
    for direction, per in summary_1["transfer_gbps"].items():
        for case, value in per.items():
            other = summary_2["transfer_gbps"].get(direction, {}).get(case, float("nan"))
            print(f"  {direction} {case:9s}: {value:7.1f} | {other:7.1f} GB/s | {pct(value, other):+6.1f}%")
    for device, value in summary_1["dispatch_us"].items():
        other = summary_2["dispatch_us"].get(device, float("nan"))
        print(f"  dispatch {device:4s}: {value:7.1f} | {other:7.1f} µs | {pct(value, other):+6.1f}%")
    for dtype, value in summary_1.get("split_part_factor", {}).items():
        other = summary_2.get("split_part_factor", {}).get(dtype, float("nan"))
        print(f"  split FFN part {dtype}: {value:5.2f} | {other:5.2f} x | {pct(value, other):+6.1f}%")
    for key, value in differences.items():
        if key.startswith("CPU experts pass") or key.startswith("host memory read"):
            print(f"  {key}: {value:+6.1f}%")
    print(f"held-out: kind device dtype shape: direct | predicted | error | drift-corrected error (reference); "
          f"{HELD_OUT_GUARD.retimed} CPU timings taken again under steal, {HELD_OUT_GUARD.stolen} still stolen")
    for r in rows:
        corrected = (f" | {r['drift_corrected_error_pct']:+6.1f}% ({r['reference']})"
                     if "drift_corrected_error_pct" in r else "")
        print(f"  {r['kind']:9s} {r['device']:4s} {r['dtype']:4s} {str(r['shape']):22s}: "
              f"{r['direct_s'] * 1e3:9.3f} | {r['predicted_s'] * 1e3:9.3f} ms | {r['error_pct']:+6.1f}%{corrected}")
    print(f"max |error| by kind: {report['held_out_max_abs_error_pct']}")
    for label, key in (("within 20%", "held_out_within_20pct"),
                       ("within 20%, CPU drift-corrected", "held_out_within_20pct_drift_corrected")):
        counts = report[key]
        hit, total = sum(h for h, _ in counts.values()), sum(t for _, t in counts.values())
        print(f"{label}: {hit}/{total}: " + ", ".join(f"{group} {h}/{t}" for group, (h, t) in counts.items()))
    for row in report["cpu_drift_pct"][1:]:
        print(f"cpu drift {row['when']}: " + ", ".join(f"{key} {v:+.1f}%" for key, v in row["pct"].items()))
    print(f"total {report['total_elapsed_s']:.0f} s; report written to {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
