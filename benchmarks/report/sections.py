"""Markdown sections of the generated report: where each part ran, Table 4 per model, the
estimator, Table 9 and Table 8. Cells that could not run show ``n/a [k]`` with the reason below."""

from __future__ import annotations

from .results import BASELINES, Comparison, Grid, why_not
from .tables import Footnotes, num, pct, ratio, table


def provenance(run: dict) -> str:
    """One line per part run: command, date, hardware, versions, bandwidths, how it ended."""
    hw, ver, bw = run.get("hardware", {}), run.get("versions", {}), run.get("bandwidth_gb_s", {})
    where = f"{hw.get('gpu', 'no GPU')}, {hw.get('cpu', '?')} ({hw.get('cores', '?')} cores)"
    soft = ", ".join(f"{k} {v}" for k, v in ver.items() if v) or f"torch {hw.get('torch', '?')}"
    links = ", ".join(f"{k} {v:.1f} GB/s" for k, v in bw.items() if isinstance(v, (int, float)))
    end = "complete" if run.get("complete") else "cut short"
    line = (f"- `{run['part']}`: `{run.get('command', '?')}` — {run.get('date', '?')}, {where}; {soft}"
            f"{'; ' + links if links else ''}; {num(run.get('elapsed_s'))} s, {end}")
    if run.get("profile"):
        line += f"; planner profile: {run['profile']}"
    return line


def provenances(grid: Grid) -> str:
    """The provenance lines of a grid's whole runs, then of the cell re-runs that replaced some cells."""
    lines = []
    for run in grid.runs:
        line = provenance(run)
        if run["part"] in grid.filled:
            earlier, kept = grid.filled[run["part"]]
            shown = sorted({f"{c['system']} {c.get('budget_gib'):g} GiB/{_context(c.get('context'))}"
                            for c in kept if c.get("system") not in ("unconstrained", "bound")})
            line += (f" — the cells it did not reach ({', '.join(shown)}) keep the {earlier.get('date', '?')} "
                     f"whole run's (commit {earlier.get('versions', {}).get('commit', '?')})")
        lines.append(line)
    for rerun in grid.reruns:
        cells = sorted({(c.get("budget_gib"), c.get("context"), c.get("batch")) for c in rerun["cells"]
                        if c.get("system") not in ("unconstrained", "bound")}, key=str)
        shown = ", ".join(f"{b:g} GiB/{c // 1024 if c and c >= 1024 else c}{'K' if c and c >= 1024 else ''}"
                          + (f"/b{n}" if n else "") for b, c, n in cells)
        line = f"{provenance(rerun)} — a cell re-run: its cells ({shown}) replace the whole run's"
        skipped = sorted({f"{c['system']} {c.get('budget_gib'):g} GiB" + (f"/b{c['batch']}" if c.get("batch") else "")
                          for c in rerun["cells"] if c.get("skipped")})
        if skipped:
            line += f"; those it did not reach in time keep the whole run's ({', '.join(skipped)})"
        lines.append(line)
    return "\n".join(lines)


def _context(tokens) -> str:
    return f"{tokens // 1024}K" if tokens and tokens >= 1024 else str(tokens)


def _value(cell: dict | None, key: str, notes: Footnotes, missing: str, fmt=num) -> str:
    if cell is None:
        return notes.mark(missing)
    reason = why_not(cell)
    if reason:
        return notes.mark(f"{cell.get('system', '?')}: {reason}")
    value = cell.get(key)
    return fmt(value)


def _ttft(cell: dict | None, notes: Footnotes, missing: str) -> str:
    text = _value(cell, "ttft_s", notes, missing)
    return f"≥{text} (est.)" if cell and not why_not(cell) and cell.get("ttft_estimated") else text


def dense_section(grid: Grid, rows: list[Comparison], notes: Footnotes, chart: str | None) -> str:
    """Table 4 of one model: decode tok/s and TTFT per budget and context."""
    bases = [b for b in BASELINES if any(k[0] == b for k in grid.cells)] or ["layers:max"]
    header = ["budget", "context", "vramshard tok/s", *[f"{b} tok/s" for b in bases], "speedup",
              "unconstrained tok/s", "bound tok/s", "vramshard TTFT s", *[f"{b} TTFT s" for b in bases],
              "TTFT speedup", "vramshard plan", "peak VRAM GiB"]
    body = []
    for row in rows:
        missing = grid.missing(row.budget)
        ours = row.ours
        free = grid.get("unconstrained", None, row.context)
        bound = grid.get("bound", row.budget, row.context)
        plan = ours.get("placement", "") if ours and not why_not(ours) else ""
        body.append([f"{row.budget:g} GiB", f"{row.context // 1024}K" if row.context >= 1024 else str(row.context),
                     _value(ours, "decode_tok_s", notes, missing),
                     *[_value(grid.get(b, row.budget, row.context), "decode_tok_s", notes, missing) for b in bases],
                     ratio(row.speedup),
                     _value(free, "decode_tok_s", notes, "the unconstrained run is missing from every part"),
                     "∞" if bound is not None and bound.get("decode_tok_s") is None else
                     _value(bound, "decode_tok_s", notes, missing),
                     _ttft(ours, notes, missing), *[_ttft(grid.get(b, row.budget, row.context), notes, missing)
                                                    for b in bases],
                     ratio(row.ttft_speedup), plan, _value(ours, "peak_vram_gib", notes, missing)])
    parts = provenances(grid)
    unrun = [p for p in grid.parts if p not in {r["part"] for r in grid.runs}]
    text = [f"### Table 4 — {grid.model}: decode and TTFT across budgets and contexts", "",
            "Decode: one token at the context shown (median step). TTFT: a prompt of that many tokens in "
            "1K-token steps; `≥… (est.)` marks TTFT extrapolated past the time cap (a lower bound). Speedup: "
            "vramshard over the best baseline that ran (decode tok/s; TTFT: baseline / vramshard). Bound: "
            "(PCIe H2D + CPU read bandwidth) / bytes a decode step must read from outside the budget "
            "(∞: the budget holds them all).", "", "Runs:", parts or "- none yet"]
    if unrun:
        text.append(f"- not run yet: {', '.join(unrun)}")
    text += ["", table(header, body)]
    if chart:
        text += ["", f"![{grid.model}: speedup over the best baseline (Figure 2 style)]({chart})"]
    return "\n".join(text)


def estimator_points(grids: list[Grid]) -> list[tuple[str, str, float, float, float | None, int | None]]:
    """(model, system, budget, context or batch, predicted ms, measured ms, "context" | "batch") of every
    cell with both a prediction and a measured step."""
    points = []
    for grid in grids:
        for key, cell in grid.cells.items():
            measured = cell.get("decode_step_ms") or cell.get("step_ms")
            if why_not(cell) or not measured or not cell.get("predicted_step_ms"):
                continue
            points.append((grid.model, key[0], key[1], key[3] or key[2], cell["predicted_step_ms"], measured,
                           "batch" if key[3] else "context"))
    return points


def estimator_section(points, chart: str | None) -> str:
    if not points:
        return "### Estimator: predicted vs measured step time\n\nNo cell has both a prediction and a measurement yet."
    body = [[model, system, "—" if budget is None else f"{budget:g} GiB", f"{kind} {where}", num(pred), num(meas),
             pct((pred - meas) / meas * 100)] for model, system, budget, where, pred, meas, kind in points]
    text = ["### Estimator: predicted vs measured step time", "",
            "Predicted: the estimator's simulation of one step of the engine's placement for that step's "
            "tokens, from the planner's profile; measured: the median step of the same cell.", "",
            table(["model", "engine", "budget", "shape", "predicted ms", "measured ms", "error"], body)]
    if chart:
        text += ["", f"![estimator: predicted vs measured step time]({chart})"]
    return "\n".join(text)


def batch_section(grid: Grid, rows: list[Comparison], notes: Footnotes, chart: str | None) -> str:
    """Table 9 / Figure 7: batched decode throughput per budget and batch size."""
    bases = [b for b in BASELINES if any(k[0] == b for k in grid.cells)] or ["layers:max"]
    body = []
    for row in rows:
        missing = grid.missing(row.budget)
        body.append([f"{row.budget:g} GiB", str(row.batch),
                     _value(row.ours, "tok_s", notes, missing),
                     *[_value(grid.get(b, row.budget, row.context, row.batch), "tok_s", notes, missing)
                       for b in bases], ratio(row.speedup),
                     row.ours.get("placement", "") if row.ours and not why_not(row.ours) else ""])
    text = [f"### Table 9 — {grid.model}: batched throughput", "",
            "Decode tokens/s of a batch of sequences, one new token each per step, at the context shown in "
            "each run's settings (`batch_ctx`).", "", "Runs:",
            provenances(grid) or "- none yet", "",
            table(["budget", "batch", "vramshard tok/s", *[f"{b} tok/s" for b in bases], "speedup",
                   "vramshard plan"], body)]
    if chart:
        text += ["", f"![{grid.model}: batched throughput (Figure 7 style)]({chart})"]
    return "\n".join(text)


def vlm_section(runs: list[dict], notes: Footnotes, chart: str | None = None) -> str:
    """Table 8: every VLM row (vramshard option sets and the transformers baseline)."""
    body = []
    for run in runs:
        for cell in run["cells"]:
            reason = why_not(cell)
            gib = 2**30
            peak = None if cell.get("peak_vram") is None else cell["peak_vram"] / gib
            if reason:
                body.append([cell.get("system", "?"), f"{cell.get('budget_gib', '?')} GiB", cell.get("options", ""),
                             cell.get("image", "—"), notes.mark(f"{cell.get('system')}: {reason}"), num(peak),
                             "", "", ""])
                continue
            body.append([cell.get("system", "?"), f"{cell.get('budget_gib')} GiB", cell.get("options", ""),
                         cell.get("image", "—"), "ok", num(peak), num(cell.get("vision_s")), num(cell.get("ttft_s")),
                         num(cell.get("e2e_128_s")) + ("" if cell.get("e2e_measured") else " (ext.)")])
    text = ["### Table 8 — Qwen2.5-VL-7B: one image per resolution under a budget", "",
            "Peak VRAM over the request; e2e: a 128-token answer (`(ext.)`: TTFT + 127 × the measured "
            "per-token time).", "", "Runs:", "\n".join(provenance(r) for r in runs) or "- none yet", "",
            table(["system", "budget", "options", "image", "status", "peak VRAM GiB", "vision s", "TTFT s",
                   "e2e 128 s"], body)]
    if chart:
        text += ["", f"![Qwen2.5-VL-7B: TTFT per image and budget]({chart})"]
    return "\n".join(text)
