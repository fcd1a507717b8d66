"""Reproducibility: a part run again, its cells compared with the earlier run's."""

from __future__ import annotations

import statistics

from .results import Runs, cell_key, why_not
from .tables import num, table

METRICS = ("decode_tok_s", "ttft_s", "tok_s", "e2e_128_s")


def differences(earlier: dict, later: dict) -> list[tuple[str, tuple, float]]:
    """(metric, cell key, percent change later vs earlier) of every measured metric both runs have
    (extrapolated TTFTs and the computed bound are left out: they are not measurements)."""
    before = {cell_key(c): c for c in earlier["cells"] if why_not(c) is None}
    out = []
    for cell in later["cells"]:
        key = cell_key(cell)
        old = before.get(key)
        if old is None or why_not(cell) is not None or cell.get("system") == "bound":
            continue
        for metric in METRICS:
            a, b = old.get(metric), cell.get(metric)
            if not a or b is None:
                continue
            if metric == "ttft_s" and (old.get("ttft_estimated") or cell.get("ttft_estimated")):
                continue
            out.append((metric, key, (b - a) / a * 100))
    return out


def noise(runs: Runs) -> dict | None:
    """Run-to-run noise over every re-run part: median and largest |change| in percent."""
    changes = [abs(d) for part_runs in runs.by_part.values() for i in range(1, len(part_runs))
               for _, _, d in differences(part_runs[i - 1], part_runs[i])]
    if not changes:
        return None
    return {"median_pct": statistics.median(changes), "max_pct": max(changes), "count": len(changes),
            "p90_pct": sorted(changes)[int(0.9 * (len(changes) - 1))]}


def section(runs: Runs) -> str:
    rows = []
    for part, part_runs in runs.by_part.items():
        for i in range(1, len(part_runs)):
            earlier, later = part_runs[i - 1], part_runs[i]
            diffs = differences(earlier, later)
            for metric in METRICS:
                values = [abs(d) for m, _, d in diffs if m == metric]
                if values:
                    rows.append([f"`{part}`", f"{earlier.get('date', '?')} → {later.get('date', '?')}", metric,
                                 str(len(values)), f"{statistics.median(values):.1f}%", f"{max(values):.1f}%"])
    text = ["### Reproducibility", ""]
    for part, reruns in runs.reruns.items():
        whole = runs.primary(part)
        for rerun in reruns:
            by_system: dict[str, list[float]] = {}
            for metric, key, change in differences(whole, rerun):
                if metric in ("decode_tok_s", "tok_s"):  # one-sequence decode, or batched throughput
                    by_system.setdefault(key[0], []).append(change)
            changes = ", ".join(f"{system} {statistics.median(values):+.0f}%"
                                + (f" (median of {len(values)} cells)" if len(values) > 1 else "")
                                for system, values in by_system.items())
            text.append(f"Cell re-run of `{part}` on {rerun.get('date', '?')} (commit "
                        f"{rerun.get('versions', {}).get('commit', '?')}, against {whole.get('date', '?')}): "
                        f"{len(rerun['cells'])} cells, not counted as noise; tokens/s change "
                        f"{changes or 'none measured'}.")
            text.append("")
    if not rows:
        text.append("No part has been run twice yet: run one part again (see benchmarks/README.md) and merge both "
                    "folders; this section then compares the two runs cell by cell.")
        return "\n".join(text)
    stated = noise(runs)
    text += [f"Run-to-run noise: median |change| {num(stated['median_pct'])}%, 90th percentile "
             f"{num(stated['p90_pct'])}%, largest {num(stated['max_pct'])}% over {stated['count']} measurements "
             f"of re-run parts (the later run fills the tables above).", "",
             table(["part", "runs", "metric", "cells", "median |change|", "largest |change|"], rows)]
    return "\n".join(text)
