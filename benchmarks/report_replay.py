"""The estimator against the report's measured decode steps, re-priced on any machine (no GPU).

Each cell of the report's part JSONs (``docs/runs/*/report-*.json``) is planned again from the
same profile, budget and context, the way ``benchmarks.report`` planned it (at the launch price
of the code that ran it), and the estimator prices its one-token step; the error is predicted
against the cell's measured ``decode_step_ms``. Knobs change the pricing, not the plans:

- ``--launches N``: kernel launches the dispatch probe stands for (the estimator's
  ``DISPATCH_LAUNCHES``; ``bench_dispatch._tiny_sublayer`` launches 10);
- ``--cpu-factor F``: the profile's CPU times x F (``Profile.calibrated(cpu_rows={1: F})``, as
  the engine's in-run calibration fits them; 1.55-1.62 on the H200 machine);
- ``--split-factor F``: split FFN parts' CPU times x F on top (``split_part_scale``, as the engine
  fits them);
- ``--profile-read-gb-s R``: the host memory read (GB/s) of the machine the profile measured; each
  part's CPU times are then scaled by R over the read its run measured (``bandwidth_gb_s.cpu_read``),
  as the engine's load-time check does (:mod:`vramshard.profile.drift`). ``h200-run15.json`` predates
  the profile's own read figure; the fifteenth session's host read about 101 GB/s.

    PYTHONPATH=src python -m benchmarks.report_replay docs/runs/2026-12-03-* --cpu-factor 1.4 --split-factor 1.2 \
        --profile-read-gb-s 101

Prints the median |error|, the cells within +-15%, and each (model, engine)'s errors in cell order.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from vramshard.plan import estimator
from vramshard.plan.estimator import Estimator
from vramshard.profile import load
from vramshard.shapes import shape_model

from .report.measure import GiB, systems_for, unconstrained


# The launch price of the code that measured the runs replayed here (all before 2026-12-04): their
# plans are re-made with it, so that each measured step is priced for the plan that ran.
PLANNED_LAUNCHES = 5


@dataclass(frozen=True)
class Cell:
    """One measured decode step of a report part, with the plan the report made for it."""

    run: str  # the folder of the part's JSON
    model: str
    engine: str
    budget_gib: float | None
    context: int
    measured_s: float
    host_read_gb_s: float | None  # the run's measured host memory read
    placement: object
    threads: int | None
    hit_rate: float


def planned_cells(files: list[Path], planned_with) -> list[Cell]:
    """Every dense part's cells with a decode step, each planned as the report planned it
    (``planned_with``, the profile as stored, at :data:`PLANNED_LAUNCHES`)."""
    cells = []
    saved = estimator.DISPATCH_LAUNCHES
    estimator.DISPATCH_LAUNCHES = PLANNED_LAUNCHES
    try:
        for file in files:
            part = json.loads(file.read_text())
            if part.get("grid") != "dense":
                continue  # batch and VLM parts time other steps
            model = shape_model(part["model"])
            chunk = part["settings"]["chunk"]
            plans: dict[tuple, list] = {}
            for cell in part["cells"]:
                if "decode_step_ms" not in cell:
                    continue
                context = cell["context"]
                if cell["system"] == "unconstrained":
                    system = unconstrained(model)
                else:
                    key = (cell["budget_gib"], context)
                    if key not in plans:
                        plans[key] = systems_for(model, int(cell["budget_gib"] * GiB), context + chunk + 16, chunk,
                                                 planned_with)
                    system = next(s for s in plans[key] if s.label == cell["system"])
                placement, threads = system.tiered.for_tokens(1)
                cells.append(Cell(file.parent.name, part["model"], cell["system"], cell.get("budget_gib"), context,
                                  cell["decode_step_ms"] / 1e3, part.get("bandwidth_gb_s", {}).get("cpu_read"),
                                  placement, threads, system.plan.expert_hit_rate if system.plan is not None else 0.0))
    finally:
        estimator.DISPATCH_LAUNCHES = saved
    return cells


def price(cells: list[Cell], priced_with, profile_read_gb_s: float | None = None,
          launches: float | None = None) -> list[float]:
    """predicted / measured - 1 of each cell, its step priced with ``priced_with`` at ``launches``
    (default: the estimator's); with ``profile_read_gb_s`` a cell's CPU times are scaled by it over
    the read its run measured."""
    saved = estimator.DISPATCH_LAUNCHES
    estimator.DISPATCH_LAUNCHES = saved if launches is None else launches
    models: dict[str, object] = {}
    try:
        errors = []
        for cell in cells:
            profile = priced_with
            if profile_read_gb_s and cell.host_read_gb_s:
                profile = priced_with.calibrated(cpu_scale=profile_read_gb_s / cell.host_read_gb_s)
            model = models.setdefault(cell.model, shape_model(cell.model))
            step = Estimator(model, profile, threads=cell.threads, expert_hit_rate=cell.hit_rate).simulate(
                cell.placement, 1, cell.context)
            errors.append(step.seconds / cell.measured_s - 1)
        return errors
    finally:
        estimator.DISPATCH_LAUNCHES = saved


def replay(files: list[Path], planned_with, priced_with, profile_read_gb_s: float | None = None,
           launches: float | None = None) -> dict[tuple[str, str], list[float]]:
    """{(model, engine): [predicted / measured - 1 per cell]}: :func:`planned_cells` priced by :func:`price`."""
    cells = planned_cells(files, planned_with)
    errors: dict[tuple[str, str], list[float]] = {}
    for cell, error in zip(cells, price(cells, priced_with, profile_read_gb_s, launches)):
        errors.setdefault((cell.model, cell.engine), []).append(error)
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="folders of part JSONs (or the files)")
    parser.add_argument("--profile", default="docs/profiles/h200-run15.json")
    parser.add_argument("--launches", type=float, default=estimator.DISPATCH_LAUNCHES)
    parser.add_argument("--cpu-factor", type=float, default=1.0)
    parser.add_argument("--split-factor", type=float, default=1.0)
    parser.add_argument("--profile-read-gb-s", type=float, default=None)
    args = parser.parse_args()
    stored = load(args.profile, check_fingerprint=False)
    priced = stored
    if args.cpu_factor != 1.0 or args.split_factor != 1.0:
        priced = stored.calibrated(cpu_rows={1: args.cpu_factor}, split_part_scale=args.split_factor)
    files = [f for run in map(Path, args.runs) for f in (sorted(run.glob("report-*.json")) if run.is_dir() else [run])]
    errors = replay(files, stored, priced, args.profile_read_gb_s, args.launches)
    every = [abs(e) for cells in errors.values() for e in cells]
    print(f"launches {args.launches:g}, CPU factor {args.cpu_factor:g}, split factor {args.split_factor:g}, "
          f"profile read {args.profile_read_gb_s or '-'} GB/s: median |error| "
          f"{100 * statistics.median(every):.1f}%, {sum(e <= 0.15 for e in every)} of {len(every)} cells within 15%")
    for (model, engine), cells in errors.items():
        print(f"  {model} {engine}: " + " ".join(f"{100 * e:+.0f}" for e in cells))


if __name__ == "__main__":
    main()
