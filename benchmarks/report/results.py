"""Part JSONs read back, and the comparisons the report is made of (no formatting here).

A part may have run several times (a re-run for reproducibility): the latest run of each
part fills the tables, the earlier ones are compared with it. A later run of only some of a
part's cells (``--budgets``/``--contexts`` narrower than the run before it) is a cell re-run: its
cells replace those cells of the part's latest whole run. Whether a re-run counts as noise
depends on the source it ran (see :mod:`.repro`), not on how many cells it measured.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from vramshard.errors import InvalidInputError

from .parts import CONTEXTS, PARTS, parts_of

log = logging.getLogger("report")
BASELINES = ("layers:max", "experts-cpu")
LEVEL = 0.05  # within ±5% of the baseline counts as level, not ahead or behind


def load_runs(paths) -> list[dict]:
    """Every part JSON (``report-*.json``) in the given files and folders (searched recursively)."""
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            files += sorted(path.rglob("report-*.json"))
        elif path.is_file():
            files.append(path)
        else:
            raise InvalidInputError(f"{path} is neither a part JSON nor a folder of them; give the folders the "
                                    f"parts wrote (their $OUT)")
    runs = []
    for file in files:
        try:
            data = json.loads(file.read_text())
        except (OSError, ValueError) as exc:
            raise InvalidInputError(f"{file} is not readable JSON ({exc}); remove it or re-run its part") from None
        if not isinstance(data, dict) or "part" not in data or "cells" not in data:
            log.warning("%s: not a report part (no 'part' / 'cells'), ignored", file)
            continue
        data["_file"] = str(file)
        runs.append(data)
    if not runs:
        raise InvalidInputError(f"no report part JSONs (report-*.json) under {', '.join(map(str, paths))}")
    return runs


def budget_key(value) -> float | None:
    return None if value is None else float(value)


def cell_key(cell: dict) -> tuple:
    return (cell.get("system"), budget_key(cell.get("budget_gib")), cell.get("context"), cell.get("batch"),
            cell.get("options"), cell.get("image"))


def why_not(cell: dict | None) -> str | None:
    """Why a cell has no numbers (None: it ran)."""
    if cell is None:
        return None
    status = cell.get("status")
    if status is not None and status != "ok":  # vlm_bench rows: "OOM", "refused (budget)", "skipped (time)"
        return f"{status}: {cell.get('error', '')}".rstrip(": ")
    if cell.get("error"):
        return str(cell["error"])
    if cell.get("skipped"):
        return str(cell["skipped"])
    return None


def coverage(run: dict) -> set[tuple]:
    """The (budget, context, batch size) cells a run set out to measure, from its settings."""
    settings = run.get("settings", {})
    return {(float(b), c, n) for b in settings.get("budgets") or () for c in settings.get("contexts") or (None,)
            for n in (settings.get("batch_sizes") or (None,) if run.get("grid") == "batch" else (None,))}


def is_cell_rerun(run: dict, whole: dict) -> bool:
    """Whether ``run`` measured a strict subset of the cells of ``whole``, an earlier run of its part."""
    mine, theirs = coverage(run), coverage(whole)
    return bool(mine) and mine < theirs


@dataclass
class Runs:
    """All whole runs by part (oldest first), the one of each part the tables use (the latest),
    the cell re-runs made since that one (oldest first), and every run of each part, whole or
    not, oldest first (``history``: what the reproducibility section compares)."""

    by_part: dict[str, list[dict]]
    reruns: dict[str, list[dict]] = field(default_factory=dict)
    history: dict[str, list[dict]] = field(default_factory=dict)

    @classmethod
    def of(cls, runs: list[dict]) -> "Runs":
        by_part: dict[str, list[dict]] = {}
        reruns: dict[str, list[dict]] = {}
        history: dict[str, list[dict]] = {}
        for run in sorted(runs, key=lambda r: (r.get("started_unix") or 0, r.get("date") or "")):
            part = run["part"]
            history.setdefault(part, []).append(run)
            if part in by_part and is_cell_rerun(run, by_part[part][-1]):
                reruns.setdefault(part, []).append(run)
                continue
            by_part.setdefault(part, []).append(run)
            reruns.pop(part, None)  # a whole run measures again what earlier cell re-runs did
        return cls(by_part, reruns, history)

    def count(self) -> int:
        return sum(map(len, self.by_part.values())) + sum(map(len, self.reruns.values()))

    def primary(self, part: str) -> dict | None:
        runs = self.by_part.get(part)
        return runs[-1] if runs else None

    def used(self) -> list[dict]:
        return [runs[-1] for runs in self.by_part.values()]

    def grid_runs(self, grid: str, model: str | None = None) -> list[dict]:
        return [r for r in self.used() if r.get("grid") == grid and (model is None or r.get("model") == model)]

    def models(self, grid: str) -> list[str]:
        names = [p.model for p in parts_of(grid)] + [r.get("model") for r in self.grid_runs(grid)]
        return list(dict.fromkeys(n for n in names if n))


@dataclass
class Grid:
    """The cells of one grid of one model from the latest run of each of its parts."""

    grid: str
    model: str
    runs: list[dict]
    parts: list[str]  # every part of this grid and model, run or not
    cells: dict[tuple, dict] = field(default_factory=dict)
    origin: dict[tuple, str] = field(default_factory=dict)  # cell key -> part name
    reruns: list[dict] = field(default_factory=list)  # cell re-runs whose cells replaced the whole run's
    # part whose whole run was cut short -> (its earlier whole run, the cells filled in from that one)
    filled: dict[str, tuple[dict, list[dict]]] = field(default_factory=dict)

    @classmethod
    def of(cls, runs: Runs, grid: str, model: str) -> "Grid":
        mine = runs.grid_runs(grid, model)
        parts = list(dict.fromkeys([p.name for p in parts_of(grid, model)] + [r["part"] for r in mine]))
        out = cls(grid, model, mine, parts)
        for run in mine:
            for cell in run["cells"]:
                key = cell_key(cell)
                if key not in out.cells:  # the unconstrained run is in every part: the first counts
                    out.cells[key] = cell
                    out.origin[key] = run["part"]
        for run in mine:  # a whole run cut short: the cells it did not reach keep the earlier whole run's
            earlier = runs.by_part[run["part"]][-2] if len(runs.by_part[run["part"]]) > 1 else None
            if run.get("complete") or earlier is None:
                continue
            kept = [cell for cell in earlier["cells"] if cell_key(cell) not in out.cells]
            for cell in kept:
                out.cells[cell_key(cell)] = cell
                out.origin[cell_key(cell)] = f"{run['part']} (whole run {earlier.get('date', '?')})"
            if kept:
                out.filled[run["part"]] = (earlier, kept)
        for run in mine:
            for rerun in runs.reruns.get(run["part"], []):
                out.reruns.append(rerun)
                for cell in rerun["cells"]:
                    key = cell_key(cell)
                    if cell.get("system") == "unconstrained":  # the whole runs' unconstrained cells stay
                        continue
                    if cell.get("skipped") and key in out.cells:  # not reached in time: the earlier cell stays
                        continue
                    out.cells[key] = cell
                    out.origin[key] = f"{rerun['part']} (cell re-run {rerun.get('date', '?')})"
        return out

    def get(self, system: str, budget=None, context=None, batch=None) -> dict | None:
        return self.cells.get((system, budget_key(budget), context, batch, None, None))

    def budgets(self) -> list[float]:
        found = set()
        for name in self.parts:
            run = next((r for r in self.runs if r["part"] == name), None)
            settings = (run or {}).get("settings", {})
            found.update(settings.get("budgets") or (PARTS[name].budgets if name in PARTS else ()))
        found.update(b for (_, b, *_rest) in self.cells if b is not None)
        return sorted(float(b) for b in found)

    def contexts(self) -> list[int]:
        found = {c for (s, _, c, *_rest) in self.cells if c is not None and s != "unconstrained"}
        return sorted(found or CONTEXTS)

    def missing(self, budget) -> str:
        """Why a cell of ``budget`` is absent: its part has not run, or stopped before it."""
        for name in self.parts:
            run = next((r for r in self.runs if r["part"] == name), None)
            budgets = ((run or {}).get("settings", {}).get("budgets")
                       or (PARTS[name].budgets if name in PARTS else ()))
            if budget is not None and float(budget) in {float(b) for b in budgets}:
                if run is None:
                    return f"part {name} has not run yet"
                if not run.get("complete"):
                    return f"part {name} stopped before this cell (cut short after {run.get('elapsed_s', 0):.0f} s)"
                return f"part {name} did not measure this cell"
        return "no part covers this cell"


def best_baseline(grid: Grid, budget, context, metric: str, batch=None) -> tuple[str | None, dict | None]:
    """The baseline with the best ``metric`` (higher tok/s, lower TTFT) that ran in this cell."""
    ran = [(label, grid.get(label, budget, context, batch)) for label in BASELINES]
    ran = [(label, c) for label, c in ran if c is not None and why_not(c) is None and c.get(metric) is not None]
    if not ran:
        return None, None
    lower_is_better = metric.startswith("ttft")
    return (min if lower_is_better else max)(ran, key=lambda lc: lc[1][metric])


def verdict(speedup: float | None) -> str | None:
    """'ahead', 'behind' or 'level' from a speedup over the baseline (None: no comparison)."""
    if speedup is None:
        return None
    if speedup > 1 + LEVEL:
        return "ahead"
    if speedup < 1 - LEVEL:
        return "behind"
    return "level"


@dataclass
class Comparison:
    """One cell of a grid: ours, the best baseline, and the speedups."""

    budget: float
    context: int | None
    batch: int | None
    ours: dict | None
    base_label: str | None
    base: dict | None
    speedup: float | None  # decode (or batched) tok/s, ours / baseline
    ttft_label: str | None = None
    ttft_speedup: float | None = None  # baseline TTFT / ours


def dense_rows(grid: Grid) -> list[Comparison]:
    rows = []
    for budget in grid.budgets():
        for context in grid.contexts():
            ours = grid.get("vramshard", budget, context)
            ok = ours is not None and why_not(ours) is None
            label, base = best_baseline(grid, budget, context, "decode_tok_s")
            speedup = ours["decode_tok_s"] / base["decode_tok_s"] if ok and base else None
            tlabel, tbase = best_baseline(grid, budget, context, "ttft_s")
            ttft = tbase["ttft_s"] / ours["ttft_s"] if ok and tbase and ours.get("ttft_s") else None
            rows.append(Comparison(budget, context, None, ours, label, base, speedup, tlabel, ttft))
    return rows


def batch_rows(grid: Grid) -> list[Comparison]:
    batches = sorted({b for (_, _, _, b, *_rest) in grid.cells if b is not None})
    rows = []
    for budget in grid.budgets():
        for batch in batches:
            context = next((c.get("context") for k, c in grid.cells.items() if k[3] == batch), None)
            ours = grid.get("vramshard", budget, context, batch)
            ok = ours is not None and why_not(ours) is None
            label, base = best_baseline(grid, budget, context, "tok_s", batch)
            speedup = ours["tok_s"] / base["tok_s"] if ok and base else None
            rows.append(Comparison(budget, context, batch, ours, label, base, speedup))
    return rows
