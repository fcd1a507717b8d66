"""How well the profile's interpolation predicts what it did not measure (no GPU needed).

Leave-one-out on a measured profile: each measured grid point is predicted by the same
:class:`~vramshard.profile.Profile` queries the planner uses, from a copy of the profile
with that point's shape, M, thread count or attention row/column removed. Only points
inside the remaining grid count (extrapolation is a different question). Then the
held-out shapes of a ``profile_check`` report (timed directly on the machine that measured
the profile) are re-predicted with the current code, each with the range of errors that any
reading linear in M and K·N between two measured shapes could reach (:func:`bracket`).

    python benchmarks/interp_check.py [--profile docs/profiles/h200-omp-active.json]
        [--results docs/results-profile-check-run3.json] [--worst 3] [--json OUT]

Kinds of leave-one-out:

- ``shape``: a (K, N) shape removed from a full matmul table, predicted at every measured M;
- ``m``: an interior M removed, predicted for every shape;
- ``shape+m``: both (an unmeasured shape at an unmeasured M, as most held-out shapes are);
- ``threads``: an interior CPU thread count removed, predicted on its grid;
- ``attention``: an interior ``n_new`` row or ``context`` column removed;
- ``transfer``: an interior size removed from a PCIe table (alone, or ``busy`` beside CPU work).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from vramshard.profile import Profile

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PROFILE = ROOT / "docs" / "profiles" / "h200-omp-active.json"
DEFAULT_RESULTS = ROOT / "docs" / "results-profile-check-run3.json"
WITHIN = 0.20


def _is_full(table: dict, data: dict) -> bool:
    if table["device"] == "cuda":
        return not table.get("contended")
    return int(table.get("threads") or 0) == int(data["cpu"]["default_threads"]) and not table.get("contended")


def _inside(value: float, others) -> bool:
    return min(others) <= value <= max(others)


def _error(predicted: float, measured: float) -> float:
    return predicted / measured - 1.0


def _without(data: dict, index: int, drop_shape: int | None, drop_m: int | None) -> Profile:
    """The profile with one shape and/or one M removed from matmul table ``index``."""
    trimmed = copy.deepcopy(data)
    target = trimmed["matmul"][index]
    if drop_shape is not None:
        del target["shapes"][drop_shape]
        del target["seconds"][drop_shape]
    if drop_m is not None:
        del target["m"][drop_m]
        for row in target["seconds"]:
            del row[drop_m]
    return Profile(trimmed)


def loo_matmul(data: dict) -> list[dict]:
    """Rows ``{kind, device, dtype, point, measured_s, predicted_s, error}`` for the full tables."""
    rows = []
    for index, table in enumerate(data["matmul"]):
        if not _is_full(table, data):
            continue
        device, dtype = table["device"], table["dtype"]
        shapes, ms, seconds = table["shapes"], table["m"], table["seconds"]
        works = [k * n for k, n in shapes]
        interior_shapes = [s for s in range(len(shapes)) if _inside(works[s], works[:s] + works[s + 1:])]
        interior_ms = range(1, len(ms) - 1)
        cases = [("shape", s, None, range(len(ms))) for s in interior_shapes]
        cases += [("m", None, j, [j]) for j in interior_ms]
        cases += [("shape+m", s, j, [j]) for s in interior_shapes for j in interior_ms]
        for kind, drop_shape, drop_m, columns in cases:
            profile = _without(data, index, drop_shape, drop_m)
            for s in range(len(shapes)) if drop_shape is None else [drop_shape]:
                k, n = shapes[s]
                for j in columns:
                    predicted = profile.matmul_s(ms[j], k, n, dtype, device)
                    rows.append(_row(kind, device, dtype, [ms[j], k, n], seconds[s][j], predicted))
    return rows


def loo_threads(data: dict) -> list[dict]:
    """An interior thread count's table removed; its points predicted through ``threads=``."""
    rows = []
    counts = sorted({int(t["threads"]) for t in data["matmul"] if t["device"] == "cpu" and t.get("threads")})
    for index, table in enumerate(data["matmul"]):
        threads = table.get("threads")
        if table["device"] != "cpu" or table.get("contended") or threads in (None, counts[0], counts[-1]):
            continue
        trimmed = copy.deepcopy(data)
        del trimmed["matmul"][index]
        trimmed["cpu"]["threads"] = [t for t in trimmed["cpu"]["threads"] if t != threads]
        profile = Profile(trimmed)
        for (k, n), row in zip(table["shapes"], table["seconds"]):
            for m, measured in zip(table["m"], row):
                predicted = profile.matmul_s(m, k, n, table["dtype"], "cpu", threads=threads)
                rows.append(_row(f"threads={threads}", "cpu", table["dtype"], [m, k, n], measured, predicted))
    return rows


def loo_attention(data: dict) -> list[dict]:
    """An interior ``n_new`` row or ``context`` column removed from an attention table."""
    rows = []
    for index, table in enumerate(data["attention"]):
        device, dtype = table["device"], table["dtype"]
        layout = (table["heads"], table["kv_heads"], table["head_dim"])
        n_news, contexts, seconds = table["n_new"], table["context"], table["seconds"]
        for i in range(1, len(n_news) - 1):
            trimmed = copy.deepcopy(data)
            target = trimmed["attention"][index]
            del target["n_new"][i]
            del target["seconds"][i]
            profile = Profile(trimmed)
            for j, context in enumerate(contexts):
                predicted = profile.attention_s(n_news[i], context, *layout, dtype, device)
                rows.append(_row("attention", device, dtype, [n_news[i], context], seconds[i][j], predicted))
        for j in range(1, len(contexts) - 1):
            trimmed = copy.deepcopy(data)
            target = trimmed["attention"][index]
            del target["context"][j]
            for row in target["seconds"]:
                del row[j]
            profile = Profile(trimmed)
            for i, n_new in enumerate(n_news):
                predicted = profile.attention_s(n_new, contexts[j], *layout, dtype, device)
                rows.append(_row("attention", device, dtype, [n_new, contexts[j]], seconds[i][j], predicted))
    return rows


def loo_transfer(data: dict) -> list[dict]:
    """An interior transfer size removed from a PCIe table."""
    rows = []
    for index, table in enumerate(data["transfer"]):
        kind = "transfer" + (" busy" if table.get("contended") else "")
        for i in range(1, len(table["bytes"]) - 1):
            trimmed = copy.deepcopy(data)
            del trimmed["transfer"][index]["bytes"][i]
            del trimmed["transfer"][index]["seconds"][i]
            predicted = Profile(trimmed).transfer_s(table["bytes"][i], table["direction"], bool(table.get("contended")))
            rows.append(_row(kind, table["direction"], "-", [table["bytes"][i]], table["seconds"][i], predicted))
    return rows


def _linear(x: float, xs: list, ys: list) -> float:
    """Linear between points, clamped below, constant throughput above (as the profile reads M)."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1] * x / xs[-1]
    hi = next(i for i, v in enumerate(xs) if v > x)
    return ys[hi - 1] + (x - xs[hi - 1]) / (xs[hi] - xs[hi - 1]) * (ys[hi] - ys[hi - 1])


def bracket(table: dict, m: int, k: int, n: int) -> tuple[float, float]:
    """Lowest and highest seconds that reading the table linearly in M and in K·N between any
    measured shape at or below ``k·n`` and any at or above could give (beyond the largest:
    constant throughput from any shape within 4×). A direct time more than 20% outside this
    range is out of reach of any such reading: the table and the direct time disagree (drift
    between runs, another kernel), not the interpolation. (The GPU's floor model is not such a
    reading and can go below the range when the neighbours straddle the launch floor.)"""
    work = k * n
    order = sorted(range(len(table["m"])), key=lambda j: table["m"][j])
    ms = [table["m"][j] for j in order]
    at_m = [(kk * nn, _linear(m, ms, [row[j] for j in order]))
            for (kk, nn), row in zip(table["shapes"], table["seconds"])]
    below = [(w, t) for w, t in at_m if w <= work]
    above = [(w, t) for w, t in at_m if w >= work]
    if not above:
        values = [t * work / w for w, t in below if w >= work / 4]
    elif not below:
        values = [t for _, t in above]
    else:
        values = [t0 if w1 == w0 else t0 + (work - w0) / (w1 - w0) * (t1 - t0) for w0, t0 in below for w1, t1 in above]
    return min(values), max(values)


def held_out(data: dict, results: dict) -> list[dict]:
    """The report's direct times against this code's predictions from the same profile."""
    profile = Profile(copy.deepcopy(data))
    rows = []
    for r in results["held_out"]:
        reachable = None
        if r["kind"] == "matmul":
            predicted = profile.matmul_s(*r["shape"], r["dtype"], r["device"])
            table = next(t for t in data["matmul"] if t["device"] == r["device"] and t["dtype"] == r["dtype"]
                         and _is_full(t, data))
            reachable = [_error(t, r["direct_s"]) for t in bracket(table, *r["shape"])]
        elif r["kind"] == "attention":
            predicted = profile.attention_s(r["shape"][0], r["shape"][1], 32, 8, 128, r["dtype"], r["device"])
        else:
            predicted = profile.transfer_s(r["shape"][0], r["device"])
        row = _row(r["kind"], r["device"], r["dtype"], r["shape"], r["direct_s"], predicted)
        row["recorded_s"] = r["predicted_s"]
        row["reachable_error"] = reachable
        rows.append(row)
    return rows


def _row(kind, device, dtype, point, measured, predicted) -> dict:
    return {"kind": kind, "device": device, "dtype": dtype, "point": point,
            "measured_s": measured, "predicted_s": predicted, "error": _error(predicted, measured)}


def summarize(rows: list[dict], worst: int) -> list[dict]:
    """Per (kind, device, dtype): count, share within 20%, median |error|, median error, worst."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["kind"], r["device"], r["dtype"])].append(r)
    out = []
    for (kind, device, dtype), group in groups.items():
        errors = [r["error"] for r in group]
        ranked = sorted(group, key=lambda r: -abs(r["error"]))
        out.append({
            "kind": kind, "device": device, "dtype": dtype, "n": len(group),
            "within": sum(abs(e) <= WITHIN for e in errors),
            "median_abs": statistics.median(abs(e) for e in errors),
            "median": statistics.median(errors),
            "rms_log": math.sqrt(statistics.fmean(math.log1p(e) ** 2 for e in errors)),
            "worst": [{"point": r["point"], "measured_s": r["measured_s"], "predicted_s": r["predicted_s"],
                       "error": r["error"]} for r in ranked[:worst]],
        })
    return out


def _print_summary(title: str, summary: list[dict]) -> None:
    print(f"\n{title}")
    print(f"  {'kind':12s} {'device':6s} {'dtype':5s} {'n':>4s} {'within 20%':>11s} {'med|err|':>9s} "
          f"{'median':>7s} {'rms log':>7s}  worst (point: measured -> predicted ms)")
    totals = defaultdict(lambda: [0, 0])
    for s in summary:
        worst = "; ".join(f"{w['point']}: {w['measured_s'] * 1e3:.4g} -> {w['predicted_s'] * 1e3:.4g} "
                          f"({w['error']:+.0%})" for w in s["worst"])
        print(f"  {s['kind']:12s} {s['device']:6s} {s['dtype']:5s} {s['n']:4d} "
              f"{s['within'] / s['n']:10.0%} {s['median_abs']:9.1%} {s['median']:+7.1%} {s['rms_log']:7.3f}  {worst}")
        totals[s["kind"]][0] += s["within"]
        totals[s["kind"]][1] += s["n"]
    print("  all: " + ", ".join(f"{kind} {w}/{n} ({w / n:.0%})" for kind, (w, n) in totals.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=str(DEFAULT_PROFILE), help="profile JSON (default %(default)s)")
    parser.add_argument("--results", default=str(DEFAULT_RESULTS),
                        help="profile_check report with held-out direct times (default %(default)s); '' to skip")
    parser.add_argument("--worst", type=int, default=3, help="worst cases shown per group (default 3)")
    parser.add_argument("--json", default="", help="also write all rows and summaries to this path")
    args = parser.parse_args(argv)

    data = json.loads(Path(args.profile).read_text())
    report: dict = {"profile": args.profile}
    loo = loo_matmul(data) + loo_threads(data) + loo_attention(data) + loo_transfer(data)
    report["leave_one_out"] = summarize(loo, args.worst)
    _print_summary(f"leave-one-out on {args.profile} (error = predicted / measured - 1)", report["leave_one_out"])

    if args.results:
        rows = held_out(data, json.loads(Path(args.results).read_text()))
        report["held_out"] = summarize(rows, args.worst)
        report["held_out_rows"] = rows
        _print_summary(f"held-out shapes of {args.results}: direct vs predicted now", report["held_out"])
        print("\n  kind      device dtype shape                 :   direct | recorded | now (ms)  | error now"
              " | reachable by linear reading between measured shapes")
        for r in rows:
            reachable = r["reachable_error"]
            reach = f" | {reachable[0]:+.0%} .. {reachable[1]:+.0%}" if reachable else ""
            print(f"  {r['kind']:9s} {r['device']:5s} {r['dtype']:4s}  {str(r['point']):22s}: "
                  f"{r['measured_s'] * 1e3:8.4f} | {r['recorded_s'] * 1e3:8.4f} | {r['predicted_s'] * 1e3:8.4f} | "
                  f"{r['error']:+6.1%}{reach}")
    if args.json:
        report["leave_one_out_rows"] = loo
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"\nwritten to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
