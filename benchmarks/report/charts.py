"""PNG charts of the report (matplotlib, no display): the paper's Figure 2 (speedup bars),
Figure 7 (throughput lines) and Table 8 as bars (VLM TTFT), and the estimator's predicted vs
measured step times."""

from __future__ import annotations

from pathlib import Path

from .results import BASELINES, Comparison, Grid, why_not


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def speedup_bars(rows: list[Comparison], model: str, path: Path) -> Path:
    """Figure 2 style: per budget, one bar per context, decode and TTFT speedup over the best
    baseline (1.0 = level); cells without a comparison are left empty."""
    plt = _pyplot()
    budgets = sorted({r.budget for r in rows})
    contexts = sorted({r.context for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    width = 0.8 / max(len(contexts), 1)
    for ax, (title, attr) in zip(axes, (("decode tok/s speedup", "speedup"), ("TTFT speedup", "ttft_speedup"))):
        for i, context in enumerate(contexts):
            values = []
            for budget in budgets:
                row = next((r for r in rows if r.budget == budget and r.context == context), None)
                values.append(getattr(row, attr) if row is not None and getattr(row, attr) else 0.0)
            xs = [b + (i - (len(contexts) - 1) / 2) * width for b in range(len(budgets))]
            ax.bar(xs, values, width, label=f"{context // 1024}K context" if context >= 1024 else f"{context} ctx")
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(budgets)), [f"{b:g} GiB" for b in budgets])
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("× over best baseline")
        ax.legend(fontsize=8)
    fig.suptitle(f"{model}: vramshard over the best baseline ({', '.join(BASELINES)})", fontsize=11)
    return _save(fig, path)


def throughput_lines(grid: Grid, path: Path) -> Path:
    """Figure 7 style: batched tokens/s against batch size, one panel per budget, one line per engine."""
    plt = _pyplot()
    budgets = grid.budgets()
    systems = list(dict.fromkeys(k[0] for k in grid.cells))
    fig, axes = plt.subplots(1, max(len(budgets), 1), figsize=(4.2 * max(len(budgets), 1), 3.6), squeeze=False)
    for ax, budget in zip(axes[0], budgets):
        for system in systems:
            points = sorted((k[3], c["tok_s"]) for k, c in grid.cells.items()
                            if k[0] == system and k[1] == budget and k[3] is not None and why_not(c) is None
                            and c.get("tok_s"))
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=system)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"{budget:g} GiB", fontsize=10)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no runs", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(f"{grid.model}: batched decode throughput", fontsize=11)
    return _save(fig, path)


def estimator_scatter(points: list[tuple[str, float, float]], path: Path) -> Path:
    """Predicted against measured step time (ms), log-log, one colour per engine, y = x dashed."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 4.6))
    for system in dict.fromkeys(p[0] for p in points):
        mine = [p for p in points if p[0] == system]
        ax.scatter([p[2] for p in mine], [p[1] for p in mine], label=system, s=18)
    values = [v for p in points for v in p[1:]] or [1.0, 10.0]
    low, high = min(values) * 0.8, max(values) * 1.25
    ax.plot([low, high], [low, high], color="black", linestyle="--", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured step (ms)")
    ax.set_ylabel("predicted step (ms)")
    ax.legend(fontsize=8)
    ax.set_title("estimator: predicted vs measured", fontsize=10)
    return _save(fig, path)


def vlm_ttft_bars(cells: list[dict], path: Path) -> Path:
    """Table 8 as bars: per budget, TTFT by image resolution for each vramshard option set and
    the transformers baseline (log scale); a row that did not run gets an ``x`` on the axis."""
    plt = _pyplot()
    series = list(dict.fromkeys((c.get("system"), c.get("options")) for c in cells))
    budgets = sorted({c["budget_gib"] for c in cells if c.get("budget_gib") is not None})
    images = list(dict.fromkeys(c["image"] for c in cells if c.get("image")))
    fig, axes = plt.subplots(1, max(len(budgets), 1), figsize=(4.6 * max(len(budgets), 1), 3.8), squeeze=False)
    width = 0.8 / max(len(series), 1)
    for ax, budget in zip(axes[0], budgets):
        for i, (system, options) in enumerate(series):
            xs, ys, missing = [], [], []
            for j, image in enumerate(images):
                x = j + (i - (len(series) - 1) / 2) * width
                cell = next((c for c in cells if (c.get("system"), c.get("options")) == (system, options)
                             and c.get("budget_gib") == budget and c.get("image") in (image, None)), None)
                if cell is not None and why_not(cell) is None and cell.get("ttft_s"):
                    xs.append(x)
                    ys.append(cell["ttft_s"])
                else:
                    missing.append(x)
            ax.bar(xs, ys, width, color=f"C{i}")  # one colour per series in every panel
            ax.scatter(missing, [0.05] * len(missing), marker="x", color=f"C{i}", s=14)
        ax.set_yscale("log")
        ax.set_ylim(bottom=0.04)
        ax.set_xticks(range(len(images)), images)
        ax.set_ylabel("TTFT (s)")
        ax.set_title(f"{budget:g} GiB", fontsize=10)
    from matplotlib.patches import Patch

    fig.legend(handles=[Patch(color=f"C{i}", label=system if system != "vramshard" else f"vramshard {options}")
                        for i, (system, options) in enumerate(series)],
               loc="lower center", ncol=len(series), fontsize=8)
    fig.suptitle("Qwen2.5-VL-7B: time to first token per image (x: did not run)", fontsize=11)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return _save(fig, path, layout=False)


def _save(fig, path: Path, layout: bool = True) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if layout:
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path
