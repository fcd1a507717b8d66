"""Studies of the estimator over the report's measured decode steps (no GPU), from session 24:

    PYTHONPATH=src python -m benchmarks.replay_studies fix            # the host-experts fix, with the in-run factors
    PYTHONPATH=src python -m benchmarks.replay_studies out-of-sample  # factors chosen on 2026-12-03, checked on 2026-12-04
    PYTHONPATH=src python -m benchmarks.replay_studies launch-price   # plans made at probe / 5 and / 10
    PYTHONPATH=src python -m benchmarks.replay_studies attention      # the profile's CPU attention x 1, 1.5, 2.2

Each replays the nine dense-part runs of ``RUNS`` (146 cells) with :mod:`benchmarks.report_replay`:
the cells planned as the report planned them, then priced. ``CPU``, ``SPLIT``: the CPU factors the
engine fits in its run (1.4 on CPU compute, 1.2 more on split FFN parts); ``READ``: the host read of
the machine ``h200-run15.json`` measured (the fifteenth session's, about 101 GB/s).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
from pathlib import Path

from vramshard.plan import estimator
from vramshard.plan.estimator import Estimator
from vramshard.profile import load
from vramshard.profile.query import Profile, dtype_name
from vramshard.shapes import shape_model

from .report.measure import GiB, systems_for
from .report_replay import planned_cells, price

RUNS = ["2026-12-03-dense-nemo-a", "2026-12-03-dense-nemo-b", "2026-12-03-dense-qwen3moe-a",
        "2026-12-04-dense-qwen3moe-b-rerun", "2026-12-04-dense-qwen3moe-c-rerun",
        "2026-12-03-dense-qwen3moe-b-warm-cache", "2026-12-03-dense-qwen3moe-c-warm-cache",
        "2026-12-03-dense-nemo-b-16gib-4k-repeat1", "2026-12-04-dense-nemo-a-6gib-16k"]
PROFILE = "docs/profiles/h200-run15.json"
CPU, SPLIT, READ = 1.4, 1.2, 101.0


def fitted(stored: Profile, cpu: float = CPU, split: float = SPLIT) -> Profile:
    return stored.calibrated(cpu_rows={1: cpu}, split_part_scale=split)


def summary(errors, chosen=None) -> str:
    chosen = list(range(len(errors))) if chosen is None else chosen
    picked = [abs(errors[i]) for i in chosen]
    return f"median |error| {100 * statistics.median(picked):.1f}%, {sum(e <= 0.15 for e in picked)} of {len(picked)} within 15%"


def median_of(cells, errors, model: str, engine: str) -> str:
    picked = [e for c, e in zip(cells, errors) if (c.model, c.engine) == (model, engine)]
    return f"{100 * statistics.median(picked):+.0f}%"


@contextlib.contextmanager
def replaced(method: str, replacement):
    """``Profile.<method>`` replaced by ``replacement(original, self, *args)`` while inside."""
    original = getattr(Profile, method)
    setattr(Profile, method, lambda self, *args, **kwargs: replacement(original, self, *args, **kwargs))
    try:
        yield
    finally:
        setattr(Profile, method, original)


def host_experts_ignoring_calibration():
    """``Profile.host_experts_rate`` as it was before session 24: the calibration's factors not applied."""
    def old(_, self, dtype, rows):
        if not self.data.get("host_experts", {}).get(dtype_name(dtype)):
            return None
        return self._factor_by_rows("host_experts", dtype, rows)

    return replaced("host_experts_rate", old)


def study_fix(cells, stored) -> None:
    after = price(cells, fitted(stored))
    with host_experts_ignoring_calibration():
        before = price(cells, fitted(stored))
    for name, errors in (("before the fix", before), ("after", after)):
        print(f"{name}: {summary(errors)}; qwen3-30b-a3b medians: layers:max "
              f"{median_of(cells, errors, 'qwen3-30b-a3b', 'layers:max')}, experts-cpu "
              f"{median_of(cells, errors, 'qwen3-30b-a3b', 'experts-cpu')}")


def study_out_of_sample(cells, stored) -> None:
    train = [i for i, c in enumerate(cells) if c.run.startswith("2026-12-03") and c.engine != "unconstrained"]
    test = [i for i, c in enumerate(cells) if c.run.startswith("2026-12-04") and c.engine != "unconstrained"]
    best = None
    for cpu, split, read in itertools.product((1.0, 1.2, 1.3, 1.4, 1.5, 1.6), (1.0, 1.2, 1.4), (None, READ)):
        errors = price(cells, fitted(stored, cpu, split), read)
        score = statistics.median(abs(errors[i]) for i in train)
        if best is None or score < best[0]:
            best = (score, cpu, split, read)
    _, cpu, split, read = best
    print(f"chosen on the {len(train)} cells of 2026-12-03: CPU factor {cpu}, split factor {split}, read {read or '-'}")
    print(f"  on the {len(test)} cells of 2026-12-04: chosen {summary(price(cells, fitted(stored, cpu, split), read), test)}")
    print(f"  with each run's read: {summary(price(cells, fitted(stored, cpu, split), READ), test)}")
    print(f"  the profile as stored: {summary(price(cells, stored), test)}")


def cpu_attention_times(factor: float):
    """``Profile.attention_s`` with its CPU figures ``factor`` times longer."""
    def scaled(original, self, n_new, context, heads, kv_heads, head_dim, dtype, device, threads=None):
        seconds = original(self, n_new, context, heads, kv_heads, head_dim, dtype, device, threads)
        return seconds * factor if str(device).startswith("cpu") else seconds

    return replaced("attention_s", scaled)


def study_attention(cells, stored) -> None:
    """The stored profile timed CPU attention hot; timed cold on the development machine it took
    about 2x. How much longer does the H200 host's replay want it (factors and read as fitted)?"""
    long_qwen = [i for i, c in enumerate(cells) if (c.model, c.engine, c.context) == ("qwen3-30b-a3b", "layers:max", 16384)]
    for factor in (1.0, 1.5, 2.2):
        with cpu_attention_times(factor):
            errors = price(cells, fitted(stored), READ)
        print(f"CPU attention x{factor}: {summary(errors)}; qwen3-30b-a3b layers:max at 16K keys median "
              f"{100 * statistics.median(errors[i] for i in long_qwen):+.0f}%")


def study_launch_price(stored) -> None:
    """nemo-8b and qwen3-30b-a3b at 2-16 GiB, 1K context: the tier-1 plan made at probe / 5 and at
    probe / 10, each priced at probe / 5 with the in-run factors (the best fit of the replay)."""
    best_fit = fitted(stored)
    saved = estimator.DISPATCH_LAUNCHES
    try:
        for name in ("nemo-8b", "qwen3-30b-a3b"):
            model = shape_model(name)
            for gib in (2, 4, 6, 8, 12, 16):
                steps = []
                for launches in (5, 10):
                    estimator.DISPATCH_LAUNCHES = launches
                    system = next(s for s in systems_for(model, gib * GiB, 1024 + 512 + 16, 512, stored)
                                  if s.label == "vramshard")
                    placement, threads = system.tiered.for_tokens(1)
                    estimator.DISPATCH_LAUNCHES = 5
                    steps.append(Estimator(model, best_fit, threads=threads, expert_hit_rate=system.plan.expert_hit_rate)
                                 .simulate(placement, 1, 1024).seconds * 1e3)
                print(f"{name} {gib:2d} GiB: plan at probe/5 {steps[0]:6.1f} ms, at probe/10 {steps[1]:6.1f} ms "
                      f"({100 * (steps[1] / steps[0] - 1):+.1f}%)")
    finally:
        estimator.DISPATCH_LAUNCHES = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("study", choices=("fix", "out-of-sample", "launch-price", "attention"))
    parser.add_argument("--profile", default=PROFILE)
    args = parser.parse_args()
    stored = load(args.profile, check_fingerprint=False)
    if args.study == "launch-price":
        study_launch_price(stored)
        return
    files = [f for run in RUNS for f in sorted(Path("docs/runs", run).glob("report-*.json"))]
    cells = planned_cells(files, stored)
    {"fix": study_fix, "out-of-sample": study_out_of_sample, "attention": study_attention}[args.study](cells, stored)


if __name__ == "__main__":
    main()
