"""Merge part JSONs into docs/BENCHMARKS.md (between the report markers) and PNG charts."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from ..common import now
from . import charts, narrative, repro, sections
from .results import Grid, Runs, batch_rows, dense_rows, load_runs
from .tables import Footnotes, splice

log = logging.getLogger("report")


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-")


def _link(path: Path, md_path: Path) -> str:
    return Path(os.path.relpath(path, md_path.parent)).as_posix()


def generate(runs: Runs, md_path: Path, charts_dir: Path, command: str) -> tuple[str, list[Path]]:
    """The generated block (markdown) and the charts it references, written to ``charts_dir``."""
    notes = Footnotes()
    pngs: list[Path] = []
    body: list[str] = []
    kinds = {  # grid kind: (paper table, rows, chart, section)
        "dense": ("Table 4", dense_rows, lambda grid, rows, path: charts.speedup_bars(rows, grid.model, path),
                  sections.dense_section, "speedup"),
        "batch": ("Table 9", batch_rows, lambda grid, rows, path: charts.throughput_lines(grid, path),
                  sections.batch_section, "batch"),
    }
    filled: dict[str, list] = {kind: [] for kind in kinds}
    for kind, (table, make_rows, chart_of, section, stem) in kinds.items():
        for model in runs.models(kind):
            grid = Grid.of(runs, kind, model)
            if not grid.runs:
                body.append(f"### {table} — {model}\n\nNot run yet: parts {', '.join(grid.parts)} have no results.")
                continue
            rows = make_rows(grid)
            filled[kind].append((grid, rows))
            png = chart_of(grid, rows, charts_dir / f"{stem}-{_slug(model)}.png")
            pngs.append(png)
            body.append(section(grid, rows, notes, _link(png, md_path)))
    dense, batch = filled["dense"], filled["batch"]
    points = sections.estimator_points([g for g, _ in dense + batch])
    chart = None
    if points:
        png = charts.estimator_scatter([(p[1], p[4], p[5]) for p in points], charts_dir / "estimator.png")
        pngs.append(png)
        chart = _link(png, md_path)
    body.append(sections.estimator_section(points, chart))
    vlm_runs = runs.grid_runs("vlm") + runs.grid_runs("vlm-hf")
    if vlm_runs:
        png = charts.vlm_ttft_bars([c for r in vlm_runs for c in r["cells"]], charts_dir / "vlm-ttft.png")
        pngs.append(png)
        body.append(sections.vlm_section(vlm_runs, notes, _link(png, md_path)))
    else:
        body.append("### Table 8 — Qwen2.5-VL-7B\n\nNot run yet: parts vlm, vlm-hf have no results.")
    body.append(repro.section(runs))
    if notes.reasons:
        body.append("### Why some cells have no number\n\n" + notes.render())
    summary = narrative.narrative(dense, batch, points, vlm_runs, _count_na(body))
    head = ["## Report: the paper's tables on this hardware (generated)", "",
            f"Generated {now()} by `{command}` from {runs.count()} part runs "
            f"({', '.join(runs.by_part)}). Everything between the report markers is rewritten by the merge; edit "
            "the text outside them.", "", ""]
    return "\n\n".join(["\n".join(head) + summary, *body]), pngs


def _count_na(blocks: list[str]) -> int:
    return sum(block.count("n/a [") for block in blocks)


def merge(paths, md_path: str | Path, charts_dir: str | Path, command: str = "python -m benchmarks.report --merge") \
        -> tuple[Path, list[Path]]:
    """Read every part JSON under ``paths``, rewrite the generated block of ``md_path`` (its text
    outside the markers is kept; a missing file is created) and the charts in ``charts_dir``."""
    md_path, charts_dir = Path(md_path), Path(charts_dir)
    runs = Runs.of(load_runs(paths))
    generated, pngs = generate(runs, md_path, charts_dir, command)
    old = md_path.read_text() if md_path.exists() else ""
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(splice(old, generated))
    log.info("wrote %s and %d charts in %s", md_path, len(pngs), charts_dir)
    return md_path, pngs
