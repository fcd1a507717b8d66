"""Showing a plan: rich tables per tier and a picture of where each sub-layer runs."""

from __future__ import annotations

import math

from ..units import format_bytes
from .planner import FAMILIES, PlanSet

COLORS = {"vram": "#2b8a3e", "stream": "#1971c2", "host": "#e8590c", "experts": "#9c36b5", "split": "#f59f00",
          "kv@host": "#66d9e8", "coded": "#8ce99a"}
LABELS = {"vram": "GPU, resident", "stream": "GPU, streamed", "host": "CPU",
          "experts": "GPU router, experts on CPU / cached", "split": "FFN split: CPU + GPU (streamed part)",
          "kv@host": "GPU attention over a host KV cache", "coded": "GPU, resident coded (decoded each step)"}


def category(where) -> str:
    """The colour key of one placement entry: its weights' home, or a split FFN, or GPU attention
    whose KV cache stays in host memory, or weights pinned coded."""
    if getattr(where, "split", False):
        return "split"
    if getattr(where, "stages_kv", False):
        return "kv@host"
    if getattr(where, "coded", False):
        return "coded"
    return where.home


def print_plan(plan: PlanSet, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    console.print(f"[bold]{plan.model_name}[/]: budget {format_bytes(plan.budget) if plan.budget else 'unlimited'}, "
                  f"context {plan.context} tokens, KV cache {plan.kv_side}")
    need = plan.need
    coded = plan.coded_names
    held = f" ({format_bytes(plan.pinned_weight_bytes)} of weights, {len(coded)} sub-layers coded)" if coded else ""
    console.print(f"VRAM: pinned weights {format_bytes(need.resident)}{held} + slots {format_bytes(need.slots)} + "
                  f"KV {format_bytes(need.kv)} + workspace {format_bytes(need.workspace)}"
                  + (f" + experts {format_bytes(need.experts)}" if need.experts else "")
                  + (f" + KV staging {format_bytes(need.kv_staging)}" if need.kv_staging else "") + " = "
                  + f"[bold]{format_bytes(need.total)}[/]")
    table = Table(title="predicted ms per step (tok/s) by plan family; * = chosen")
    table.add_column("tier", justify="right")
    families = [f for f in FAMILIES if any(f in tp.candidates for tp in plan.tiers.values())]
    families += sorted({f for tp in plan.tiers.values() for f in tp.candidates} - set(families))
    for family in families:
        table.add_column(family, justify="right")
    table.add_column("threads", justify="right")
    for tier, tp in sorted(plan.tiers.items()):
        cells = []
        for family in families:
            seconds = tp.candidates.get(family, math.inf)
            if not math.isfinite(seconds):
                cells.append("-")
                continue
            text = f"{seconds * 1e3:.1f} ({tier / seconds:.1f})"
            cells.append(f"[bold green]{text}*[/]" if family == tp.family else text)
        table.add_row(str(tier), *cells, str(tp.threads or "-"))
    console.print(table)
    packed = [str(tier) for tier, tp in sorted(plan.tiers.items()) if tp.cpu_packed]
    if packed:
        console.print(f"dense FFNs' CPU work from weights prepacked for oneDNN at tier(s) {', '.join(packed)} "
                      "(where the profile times them faster than the plain ones)")
    if plan.reasons:
        pins = Table(title="pinned in VRAM, by step time saved per GiB (summed over tiers, relative)")
        pins.add_column("sub-layer")
        pins.add_column("size", justify="right")
        pins.add_column("score", justify="right")
        pins.add_column("saved at tier 1 / largest", justify="right")
        first, last = min(plan.tiers), max(plan.tiers)
        for r in plan.reasons[:12]:
            pins.add_row(r.name, format_bytes(r.nbytes), f"{r.score:.3f}",
                         f"{r.saved_s[first] * 1e3:.2f} / {r.saved_s[last] * 1e3:.2f} ms")
        if len(plan.reasons) > 12:
            pins.add_row(f"... {len(plan.reasons) - 12} more", "", "", "")
        console.print(pins)
    for note in plan.notes:
        console.print(f"note: {note}")


def plot_plan(plan: PlanSet, path: str) -> None:
    """A grid: one row per tier, one column per sub-layer, coloured by where it runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    tiers = sorted(plan.tiers)
    names = [n for n, _ in plan.tiers[tiers[0]].placement.where]
    fig, ax = plt.subplots(figsize=(max(8, len(names) * 0.12), 1.0 + 0.45 * len(tiers)))
    for row, tier in enumerate(tiers):
        where = plan.tiers[tier].placement.as_dict()
        for col, name in enumerate(names):
            ax.add_patch(plt.Rectangle((col, row), 0.95, 0.9, color=COLORS[category(where[name])]))
    ax.set_xlim(0, len(names))
    ax.set_ylim(0, len(tiers))
    ax.set_yticks([r + 0.45 for r in range(len(tiers))])
    ax.set_yticklabels([f"{t} tok: {plan.tiers[t].family}" for t in tiers])
    step = max(1, len(names) // 20)
    ax.set_xticks([c + 0.45 for c in range(0, len(names), step)])
    ax.set_xticklabels(names[::step], rotation=60, fontsize=7)
    shown = {category(w) for t in tiers for _, w in plan.tiers[t].placement.where}
    ax.legend(handles=[Patch(color=COLORS[k], label=LABELS[k]) for k in COLORS if k in shown], loc="upper center",
              bbox_to_anchor=(0.5, -0.35), ncol=3, fontsize=8)
    budget = format_bytes(plan.budget) if plan.budget else "unlimited"
    ax.set_title(f"{plan.model_name}: where each sub-layer runs per token tier (budget {budget})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
