"""Reproducibility: each run of a part compared, cell by cell, with the runs before it.

A later run's cell is compared with the latest earlier run of its part that measured the same
cell. Only comparisons of two runs of the same source count as run-to-run noise: the same commit,
or commits whose measuring code (:data:`SOURCE`: the engine, and the benchmark modules a part
runs) does not differ (git says). The report's merge and formatting modules are not in it: a
change there alters no measurement. A re-run after a change of the measuring code measures the
change, and is reported as one, not as noise.
"""

from __future__ import annotations

import functools
import statistics
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .results import Runs, cell_key, why_not
from .tables import num, table

METRICS = ("decode_tok_s", "ttft_s", "tok_s", "e2e_128_s")
RATES = ("decode_tok_s", "tok_s")  # one-sequence decode, or batched throughput
# What a run's numbers depend on, besides the machine: the engine and every benchmark module that
# `python -m benchmarks.report --part ...` imports (tests/test_report.py checks this list against
# the imports).
SOURCE = ("src", "benchmarks/__init__.py", "benchmarks/common.py", "benchmarks/engine_bench.py",
          "benchmarks/executor_bench.py", "benchmarks/moe_bench.py", "benchmarks/vlm_bench.py",
          *(f"benchmarks/report/{name}.py" for name in ("__init__", "__main__", "run", "grids", "measure",
                                                          "parts", "record", "vlm_part")))
ROOT = Path(__file__).resolve().parents[2]


@functools.lru_cache(maxsize=None)
def source_changed(earlier: str, later: str) -> bool | None:
    """Whether :data:`SOURCE` differs between two commits of this repository (None: git cannot
    tell, e.g. a commit it does not have, or no git)."""
    try:
        done = subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", earlier, later, "--", *SOURCE],
                              capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return {0: False, 1: True}.get(done.returncode)


def commit_of(run: dict) -> str | None:
    return (run.get("versions") or {}).get("commit")


def same_source(earlier: dict, later: dict) -> bool | None:
    """Whether two runs ran the same engine and report code (None: not known)."""
    a, b = commit_of(earlier), commit_of(later)
    if not a or not b:
        return None
    if a == b:
        return True
    changed = source_changed(a, b)
    return None if changed is None else not changed


def measured(cell: dict) -> bool:
    return why_not(cell) is None and cell.get("system") != "bound"  # the bound is computed, not measured


@dataclass
class Comparison:
    """One later run's cells against those of one earlier run of the same part."""

    part: str
    earlier: dict
    later: dict
    changes: list[tuple[str, tuple, float]]  # (metric, cell key, percent change later vs earlier)
    same: bool | None  # same_source(earlier, later)

    @property
    def cells(self) -> int:
        return len({key for _, key, _ in self.changes})

    def rate_changes(self) -> dict[str, list[float]]:
        """Percent tokens/s changes by system."""
        out: dict[str, list[float]] = {}
        for metric, key, change in self.changes:
            if metric in RATES:
                out.setdefault(key[0], []).append(change)
        return out


def changes(pairs) -> list[tuple[str, tuple, float]]:
    """(metric, cell key, percent change) of every metric both cells of each (earlier, later) pair
    measured; extrapolated TTFTs are left out (they are not measurements)."""
    out = []
    for old, new in pairs:
        for metric in METRICS:
            a, b = old.get(metric), new.get(metric)
            if not a or b is None:
                continue
            if metric == "ttft_s" and (old.get("ttft_estimated") or new.get("ttft_estimated")):
                continue
            out.append((metric, cell_key(new), (b - a) / a * 100))
    return out


def comparisons(runs: Runs) -> list[Comparison]:
    """Every run of every part against the runs before it (see the module docstring)."""
    out = []
    for part, history in runs.history.items():
        index = [{cell_key(c): c for c in run["cells"] if measured(c)} for run in history]
        for i in range(1, len(history)):
            pairs: dict[int, list[tuple[dict, dict]]] = {}
            for key, cell in index[i].items():
                j = next((j for j in range(i - 1, -1, -1) if key in index[j]), None)
                if j is not None:
                    pairs.setdefault(j, []).append((index[j][key], cell))
            for j, matched in sorted(pairs.items()):
                found = changes(matched)
                if found:
                    out.append(Comparison(part, history[j], history[i], found, same_source(history[j], history[i])))
    return out


def _spread(values: list[float]) -> dict:
    values = sorted(abs(v) for v in values)
    return {"median_pct": statistics.median(values), "max_pct": values[-1], "count": len(values),
            "p90_pct": values[int(0.9 * (len(values) - 1))]}


def noise(found: list[Comparison]) -> dict | None:
    """Run-to-run noise over the same-source ones of ``found`` (:func:`comparisons`): median, 90th
    percentile and largest |change| in percent."""
    values = [d for c in found if c.same for _, _, d in c.changes]
    return _spread(values) if values else None


def noise_by_engine(found: list[Comparison]) -> dict[tuple[str, str], dict]:
    """:func:`noise` apart for each (system, metric): an engine whose step waits on the host CPU
    moves with that CPU, one that waits on PCIe does not, and one pooled figure hides which."""
    values: dict[tuple[str, str], list[float]] = {}
    for c in found:
        if c.same:
            for metric, key, change in c.changes:
                values.setdefault((key[0], metric), []).append(change)
    return {group: _spread(found_values) for group, found_values in sorted(values.items())}


def host_read(run: dict) -> float | None:
    """The CPU's read bandwidth the run measured beside its cells (GB/s), the host figure that the
    engines computing on the CPU follow."""
    return (run.get("bandwidth_gb_s") or {}).get("cpu_read")


def _run_label(run: dict) -> str:
    return f"{run.get('date', '?')} (commit {commit_of(run) or '?'})"


def _rate_line(comparison: Comparison) -> str:
    by_system = comparison.rate_changes()
    return ", ".join(f"{system} {statistics.median(values):+.0f}%"
                     + (f" (median of {len(values)} cells)" if len(values) > 1 else "")
                     for system, values in by_system.items()) or "none measured"


def section(runs: Runs) -> str:
    text = ["### Reproducibility", "",
            "Each run of a part is compared, cell by cell, with the latest earlier run that measured the same "
            "cell. Only runs of the same source count as noise: the same commit, or commits whose "
            "engine (`src/`) and measuring benchmark modules (`benchmarks/report/repro.py`'s `SOURCE`) do not "
            "differ. A re-run after a change of that code measures the change.", ""]
    found = comparisons(runs)
    if not found:
        text.append("No part has been run twice yet: run one part again (see benchmarks/README.md) and merge both "
                    "folders; this section then compares the two runs cell by cell.")
        return "\n".join(text)
    rows = []
    for c in found:
        if not c.same:
            why = "the source changed" if c.same is False else "unknown commits, the source may differ"
            text += [f"Re-run of `{c.part}` on {_run_label(c.later)} against {_run_label(c.earlier)}: {c.cells} cell{'' if c.cells == 1 else 's'}, "
                     f"not counted as noise ({why}); tokens/s change {_rate_line(c)}.", ""]
            continue
        hosts = f"{num(host_read(c.earlier))} → {num(host_read(c.later))}"
        for system, metric in sorted({(key[0], m) for m, key, _ in c.changes}):
            values = [abs(d) for m, key, d in c.changes if m == metric and key[0] == system]
            rows.append([f"`{c.part}`", f"{c.earlier.get('date', '?')} → {c.later.get('date', '?')}",
                         commit_of(c.later) or "?", hosts, system, metric, str(len(values)),
                         f"{statistics.median(values):.1f}%", f"{max(values):.1f}%"])
    stated = noise(found)
    if stated is None:
        text.append("No part has been re-run on the same source yet: the run-to-run noise is not measured.")
        return "\n".join(text)
    by_engine = noise_by_engine(found)
    text += [f"Run-to-run noise (same-source re-runs): median |change| {num(stated['median_pct'])}%, "
             f"90th percentile {num(stated['p90_pct'])}%, largest {num(stated['max_pct'])}% over "
             f"{stated['count']} measurements (the latest run fills the tables above). By engine and metric "
             "(the engines that compute on the CPU follow the host's CPU, which differs between machines of "
             "one type: its read bandwidth, measured in each run, is in the second table):", "",
             table(["engine", "metric", "measurements", "median |change|", "90th percentile", "largest |change|"],
                   [[system, metric, str(v["count"]), f"{v['median_pct']:.1f}%", f"{v['p90_pct']:.1f}%",
                     f"{v['max_pct']:.1f}%"] for (system, metric), v in by_engine.items()]), "",
             "The same-source re-runs, each against the run before it:", "",
             table(["part", "runs", "commit", "host CPU read GB/s", "engine", "metric", "cells", "median |change|",
                    "largest |change|"], rows)]
    return "\n".join(text)
