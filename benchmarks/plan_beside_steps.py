"""Decode steps while a full plan is made beside them: on a thread of the engine's process, against
in the planning process (:mod:`vramshard.runtime.plan_process`) with the steps on every core and with
them sparing it one (the default: ``Executor.spare_a_core``), against no planning at all; and the
planner's quick plan (no per-sub-layer search) in the process with a core spared, which a fit's re-plan
makes first (``budget_follower.QUICK_REPLAN``).

The steps are a CPU engine's (``--shape``, random weights, all on the CPU: the host thread's
Python and torch calls are what a planning thread takes the GIL from, on any machine). The plan is
the one the budget follower makes in the background after a quick plan or a calibration:
``--plan-shape`` under ``--vram`` with ``--profile``, made over and over while ``--steps`` decode
steps run. Each condition's decode steps' median and slowest are reported, and how long each plan
took to come back while the steps ran (a plan still out when they end is counted as such: the idle
scheduling class's child waits for a core none of the steps' threads wants), in one process run.
No GPU is needed. Example (the development machine)::

    PYTHONPATH=src python -m benchmarks.plan_beside_steps --profile docs/profiles/h100-run34.json --steps 400
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import threading
import time

import torch

from benchmarks.common import hardware, now, out_dir, write_json
from vramshard import budget_follower
from vramshard.engine import Engine
from vramshard.models import build_model
from vramshard.plan.tiers import Tiers
from vramshard.profile.store import load
from vramshard.runtime import budget as budgets
from vramshard.runtime.host_weights import pack_model
from vramshard.runtime import plan_process
from vramshard.shapes import random_weights, shape_config
from vramshard.units import parse_size

log = logging.getLogger("plan_beside_steps")


def decode_step_seconds(engine, steps: int, prompt: int = 16) -> list[float]:
    """Seconds of each of ``steps`` decode steps of one sequence (after its prompt)."""
    scheduler = engine.scheduler(max_seqs=1, max_context=prompt + steps + 8, ignore_eos=True)
    scheduler.add(list(range(1, prompt + 1)), max_new_tokens=steps + 1)
    seconds = []
    while scheduler.has_work:
        stats = scheduler.step()
        if stats is not None and stats.prefill_tokens == 0:
            seconds.append(stats.seconds)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama3-8b", help="the stepping engine's shape (CPU, random weights)")
    parser.add_argument("--layers", type=int, default=2, help="its layers")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--plan-shape", default="llama3-8b", help="the shape planned beside the steps")
    parser.add_argument("--vram", default="2GiB")
    parser.add_argument("--profile", required=True, help="profile file the plans are made with (any machine's)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--threads", type=int, default=None,
                        help="the engine's CPU threads (default: all cores; the planning process takes one)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    dtype = getattr(torch, args.dtype)

    config = shape_config(args.shape)
    config["num_hidden_layers"] = args.layers
    model = build_model(config, dtype)
    engine = Engine.from_host(model, pack_model(list(model), random_weights(model), pin=False), device="cpu",
                              placement="cpu", max_context=256, threads=args.threads)
    plan_model = build_model(shape_config(args.plan_shape), dtype)
    settings = budgets.PlanSettings(load(args.profile, check_fingerprint=False), Tiers(), 2048, 2, args.plan_shape)
    budget = parse_size(args.vram)
    child = plan_process.shared()  # (the engine's: its steps spare a core while this one plans)
    child.make_plan(plan_model, settings, budget)  # (started before the timed runs)
    began = time.perf_counter()
    budgets.make_plan(plan_model, settings, budget)
    alone_s = time.perf_counter() - began

    def planning(make) -> tuple[threading.Event, threading.Thread, list, list]:
        stop, plans, out = threading.Event(), [], []

        def run():
            while not stop.is_set():
                began = time.perf_counter()
                out.append(began)
                make(plan_model, settings, budget)
                plans.append((time.perf_counter() - began, stop.is_set()))
                out.clear()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return stop, thread, plans, out

    decode_step_seconds(engine, 8)  # warm-up
    results = {"date": now(), "hardware": hardware(), "args": vars(args), "plan_alone_s": alone_s, "conditions": {}}

    def quick(model, settings, budget):  # the planner's quick plan (no per-sub-layer search), in the process
        return child.make_plan(model, settings, budget, None, False)

    for name, make, spare in (("no planning", None, True), ("planning on a thread", budgets.make_plan, True),
                              ("planning in the process, steps on every core", child.make_plan, False),
                              ("planning in the process, a core spared", child.make_plan, True),
                              ("quick plans in the process, a core spared", quick, True)):
        budget_follower.SPARE_PLANNING_CORE = spare
        if make is not None:
            stop, thread, plans, out = planning(make)
            time.sleep(0.2)
        began = time.perf_counter()
        seconds = decode_step_seconds(engine, args.steps)
        ran_s = time.perf_counter() - began
        row = {"median_ms": 1e3 * statistics.median(seconds), "max_ms": 1e3 * max(seconds),
               "mean_ms": 1e3 * statistics.fmean(seconds), "steps": len(seconds), "steps_s": ran_s}
        if make is not None:
            stop.set()
            outstanding = time.perf_counter() - out[0] if out else None  # (a plan still out as the steps end)
            thread.join()
            back = [s for s, late in plans if not late]  # plans that came back while the steps ran
            row.update(plans_back=len(back), plan_s_median=statistics.median(back) if back else None,
                       plan_out_at_end_s=outstanding)
        results["conditions"][name] = row
        log.info("%s: %s", name, json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}))
    budget_follower.SPARE_PLANNING_CORE = True
    child.close()
    target = args.out or out_dir() / "plan_beside_steps.json"
    write_json(target, results)
    log.info("written %s", target)


if __name__ == "__main__":
    main()
