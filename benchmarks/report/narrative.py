"""The report's opening lines, computed from the numbers: per grid, where vramshard is ahead of
the best baseline, where behind, and what the measurements say about why. No hand-written claims."""

from __future__ import annotations

import statistics

from .results import LEVEL, Comparison, Grid, verdict, why_not


def _cell_name(row: Comparison) -> str:
    where = f"{row.context // 1024}K" if row.context and row.context >= 1024 else f"ctx {row.context}"
    return f"{row.budget:g} GiB / " + (f"batch {row.batch}" if row.batch is not None else where)


def _why_behind(row: Comparison) -> str:
    """What the cell's own numbers say: the plan, and the estimator's error on it."""
    ours = row.ours or {}
    parts = [f"plan {ours.get('placement', '?')}"]
    measured = ours.get("decode_step_ms") or ours.get("step_ms")
    pred = ours.get("predicted_step_ms")
    if measured and pred:
        err = (pred - measured) / measured * 100
        parts.append(f"estimator predicted {pred:.0f} ms, measured {measured:.0f} ms ({err:+.0f}%)")
    return "; ".join(parts)


def _counts(rows: list[Comparison], attr: str) -> dict[str, list[Comparison]]:
    out: dict[str, list[Comparison]] = {"ahead": [], "behind": [], "level": []}
    for row in rows:
        v = verdict(getattr(row, attr))
        if v:
            out[v].append(row)
    return out


def _span(rows: list[Comparison], attr: str) -> str:
    low, high = (f"{f(getattr(r, attr) for r in rows):.2f}" for f in (min, max))
    return f"{low}×" if low == high else f"{low}–{high}×"


def grid_lines(title: str, rows: list[Comparison], attr: str, metric: str) -> list[str]:
    """One sentence for a grid and metric, then one line per cell where vramshard is behind."""
    counts = _counts(rows, attr)
    compared = sum(len(v) for v in counts.values())
    if not compared:
        return [f"- **{title}, {metric}**: no cell where both vramshard and a baseline ran yet."]
    text = f"- **{title}, {metric}**: vramshard is ahead of the best baseline in {len(counts['ahead'])} of {compared} cells"
    if counts["ahead"]:
        text += f" ({_span(counts['ahead'], attr)})"
    text += f", behind in {len(counts['behind'])}"
    if counts["behind"]:
        text += f" ({_span(counts['behind'], attr)})"
    text += f", level (within ±{LEVEL * 100:.0f}%) in {len(counts['level'])}."
    lines = [text]
    for row in counts["behind"]:
        lines.append(f"  - behind at {_cell_name(row)}: {getattr(row, attr):.2f}× against {row.base_label}; "
                     f"{_why_behind(row)}.")
    return lines


def bound_line(grid: Grid, rows: list[Comparison]) -> str | None:
    """How close the planned engine comes to the physical bound (median fraction over cells)."""
    fractions = []
    for row in rows:
        bound = grid.get("bound", row.budget, row.context)
        if row.ours and not why_not(row.ours) and bound and bound.get("decode_tok_s"):
            fractions.append(row.ours["decode_tok_s"] / bound["decode_tok_s"])
    if not fractions:
        return None
    return (f"  - against the physical bound: median {statistics.median(fractions) * 100:.0f}% of it "
            f"(range {min(fractions) * 100:.0f}–{max(fractions) * 100:.0f}%, {len(fractions)} cells).")


def estimator_line(points) -> str | None:
    errors = [abs(pred - meas) / meas * 100 for *_, pred, meas, _kind in points]
    if not errors:
        return None
    worst = max(points, key=lambda p: abs(p[4] - p[5]) / p[5])
    return (f"- **Estimator**: median |error| {statistics.median(errors):.0f}% over {len(errors)} cells; "
            f"worst {(worst[4] - worst[5]) / worst[5] * 100:+.0f}% ({worst[0]}, {worst[1]}).")


def vlm_lines(runs: list[dict]) -> list[str]:
    """vramshard (all optimizations on) against transformers per budget and image: TTFT and who ran."""
    rows = [c for r in runs for c in r["cells"]]
    ours = {(c.get("budget_gib"), c.get("image")): c for c in rows
            if c.get("system") == "vramshard" and c.get("options") == "all_on"}
    theirs = {(c.get("budget_gib"), c.get("image")): c for c in rows if c.get("system") == "transformers"}
    speedups, e2e, behind, only_ours, only_theirs = [], [], [], 0, 0
    for key, mine in ours.items():
        other = theirs.get(key)
        if other is None:
            continue
        ok_mine, ok_other = why_not(mine) is None, why_not(other) is None
        if ok_mine and ok_other and mine.get("ttft_s") and other.get("ttft_s"):
            speedup = other["ttft_s"] / mine["ttft_s"]
            speedups.append(speedup)
            if verdict(speedup) == "behind":
                behind.append(f"{key[0]:g} GiB/{key[1]} ({mine['ttft_s']:.2f} s vs {other['ttft_s']:.2f} s)")
            if mine.get("e2e_128_s") and other.get("e2e_128_s"):
                e2e.append(other["e2e_128_s"] / mine["e2e_128_s"])
        only_ours += ok_mine and not ok_other
        only_theirs += ok_other and not ok_mine
    if not ours:
        return ["- **VLM**: no vramshard rows yet."]
    ahead = sum(verdict(x) == "ahead" for x in speedups)
    line = (f"- **VLM (TTFT, all optimizations on vs transformers device_map=auto)**: ahead in {ahead} of "
            f"{len(speedups)}" + (f" ({min(speedups):.2f}–{max(speedups):.2f}×)" if speedups else "")
            + f", behind in {len(behind)}" + (f" ({', '.join(behind)})" if behind else "")
            + (f"; 128-token answers {min(e2e):.1f}–{max(e2e):.1f}× sooner" if e2e else "")
            + f"; ran where transformers failed in {only_ours}, failed where transformers ran in {only_theirs}.")
    goal = ours.get((2, "1440p"))
    if goal is not None and why_not(goal) is None and goal.get("peak_vram") is not None:
        peak = goal["peak_vram"] / 2**30
        line += f" 1440p at 2 GiB: peak {peak:.2f} GiB ({'within' if peak <= 2 else 'over'} the 2 GiB goal)."
    return [line]


def narrative(dense: list[tuple[Grid, list[Comparison]]], batch: list[tuple[Grid, list[Comparison]]],
              points, vlm_runs: list[dict], not_run: int) -> str:
    lines = ["### Summary (computed from the tables below)", ""]
    for grid, rows in dense:
        title = f"Table 4, {grid.model}"
        lines += grid_lines(title, rows, "speedup", "decode tok/s")
        bound = bound_line(grid, rows)
        if bound:
            lines.append(bound)
        lines += grid_lines(title, rows, "ttft_speedup", "TTFT")
    for grid, rows in batch:
        lines += grid_lines(f"Table 9, {grid.model}", rows, "speedup", "batched tok/s")
    if vlm_runs:
        lines += vlm_lines(vlm_runs)
    estimator = estimator_line(points)
    if estimator:
        lines.append(estimator)
    lines.append(f"- **Not run**: {not_run} table entries have no number; each says why in the notes at the end.")
    return "\n".join(lines)
