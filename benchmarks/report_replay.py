"""The estimator against the report's measured decode steps, re-priced on any machine (no GPU).

Each cell of the report's part JSONs (``docs/runs/*/report-*.json``) is planned again from the
same profile, budget and context, the way ``benchmarks.report`` planned it, and the estimator
prices its one-token step; the error is predicted against the cell's measured ``decode_step_ms``.
Two knobs try out corrections without changing the code:

- ``--launches N``: kernel launches the dispatch probe stands for (the estimator's
  ``DISPATCH_LAUNCHES``, 5; ``bench_dispatch._tiny_sublayer`` launches 10);
- ``--cpu-factor F``: the profile's CPU times × F (``Profile.calibrated(cpu_rows={1: F})``, as
  the engine's in-run calibration fits them; 1.55-1.62 on the H200 machine).

    PYTHONPATH=src python -m benchmarks.report_replay docs/runs/2026-12-03-* --launches 10 --cpu-factor 1.4

Prints the median |error|, the cells within ±15%, and each (model, engine)'s errors in cell order.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from vramshard.plan import estimator
from vramshard.plan.estimator import Estimator
from vramshard.profile import load
from vramshard.shapes import shape_model

from .report.measure import GiB, systems_for, unconstrained


def replay(files: list[Path], profile) -> dict[tuple[str, str], list[float]]:
    """{(model, engine): [predicted / measured - 1 per cell]} over every dense part's cells with a decode step."""
    errors: dict[tuple[str, str], list[float]] = {}
    for file in files:
        part = json.loads(file.read_text())
        if part.get("grid") != "dense":
            continue  # batch and VLM parts time other steps
        model = shape_model(part["model"])
        chunk = part["settings"]["chunk"]
        for cell in part["cells"]:
            if "decode_step_ms" not in cell:
                continue
            context = cell["context"]
            if cell["system"] == "unconstrained":
                system = unconstrained(model)
            else:
                systems = systems_for(model, int(cell["budget_gib"] * GiB), context + chunk + 16, chunk, profile)
                system = next(s for s in systems if s.label == cell["system"])
            placement, threads = system.tiered.for_tokens(1)
            hit = system.plan.expert_hit_rate if system.plan is not None else 0.0
            step = Estimator(model, profile, threads=threads, expert_hit_rate=hit).simulate(placement, 1, context)
            errors.setdefault((part["model"], cell["system"]), []).append(
                step.seconds * 1e3 / cell["decode_step_ms"] - 1)
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="folders of part JSONs (or the files)")
    parser.add_argument("--profile", default="docs/profiles/h200-run15.json")
    parser.add_argument("--launches", type=float, default=estimator.DISPATCH_LAUNCHES)
    parser.add_argument("--cpu-factor", type=float, default=1.0)
    args = parser.parse_args()
    estimator.DISPATCH_LAUNCHES = args.launches
    profile = load(args.profile, check_fingerprint=False)
    if args.cpu_factor != 1.0:
        profile = profile.calibrated(cpu_rows={1: args.cpu_factor})
    files = [f for run in map(Path, args.runs) for f in (sorted(run.glob("report-*.json")) if run.is_dir() else [run])]
    errors = replay(files, profile)
    every = [abs(e) for cells in errors.values() for e in cells]
    print(f"launches {args.launches:g}, CPU factor {args.cpu_factor:g}: median |error| "
          f"{100 * statistics.median(every):.1f}%, {sum(e <= 0.15 for e in every)} of {len(every)} cells within 15%")
    for (model, engine), cells in errors.items():
        print(f"  {model} {engine}: " + " ".join(f"{100 * e:+.0f}" for e in cells))


if __name__ == "__main__":
    main()
