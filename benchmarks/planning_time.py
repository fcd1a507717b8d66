"""How long re-planning takes when the VRAM budget changes: the planner's quick plan (no
per-sub-layer search; what a shrinking budget gets first) against its full plan, and how far the
quick plan's predicted step times are from the full plan's, per shape and budget.

    PYTHONPATH=src python -m benchmarks.planning_time --shapes llama3-8b,nemo-8b,qwen3-30b-a3b \\
        --budgets 4,8,15 --profile docs/profiles/h200-default-omp.json --json planning.json

It needs no GPU: planning is arithmetic on a machine profile (pass the GPU machine's with
``--profile``); the times are this machine's CPU time for planning.
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

from vramshard.plan.planner import Planner
from vramshard.plan.tiers import Tiers
from vramshard.profile import load
from vramshard.shapes import shape_model

from .common import hardware, now, write_json

GiB = 2**30
log = logging.getLogger("planning_time")


def time_plan(model, profile, budget: int, context: int, tiers: Tiers, search: bool) -> tuple[float, object]:
    start = time.perf_counter()
    plan = Planner(model, profile, budget, context=context, tiers=tiers, search=search).plan()
    return time.perf_counter() - start, plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="llama3-8b,nemo-8b,qwen3-30b-a3b")
    parser.add_argument("--dtype", default=None, help="weights dtype (default: each shape's)")
    parser.add_argument("--budgets", default="4,8,15", help="GiB")
    parser.add_argument("--tiers", default="1,4,16,64,256")
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--profile", default="docs/profiles/h200-default-omp.json")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    profile = load(args.profile, check_fingerprint=False)
    tiers = Tiers(tuple(int(t) for t in args.tiers.split(",")))
    rows = []
    for shape in args.shapes.split(","):
        model = shape_model(shape, getattr(torch, args.dtype) if args.dtype else None)
        for gib in (float(b) for b in args.budgets.split(",")):
            budget = int(gib * GiB)
            full_s, full = time_plan(model, profile, budget, args.ctx, tiers, search=True)
            quick_s, quick = time_plan(model, profile, budget, args.ctx, tiers, search=False)
            gap = {t: quick.tiers[t].predicted_s / full.tiers[t].predicted_s - 1 for t in full.tiers}
            row = {"shape": shape, "budget_gib": gib, "full_s": full_s, "quick_s": quick_s,
                   "quick_slower_pct": {str(t): 100 * g for t, g in gap.items()}}
            rows.append(row)
            log.info("%-14s %5.1f GiB: full plan %.2f s, quick plan %.2f s (%.0fx); quick plan's predicted step "
                     "%s%% slower by tier", shape, gib, full_s, quick_s, full_s / quick_s,
                     " / ".join(f"{100 * g:+.1f}" for g in gap.values()))
    if args.json:
        write_json(args.json, {"date": now(), "hardware": hardware(), "args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
