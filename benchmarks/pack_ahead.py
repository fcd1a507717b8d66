"""A re-plan's packed CPU parts made before its switch (``VRAMSHARD_PACK_AHEAD``) against at it: the steps' stall.

    PYTHONPATH=src python -m benchmarks.pack_ahead [--shape llama3-8b] [--layers 4] [--rounds 2] [--json out.json]

A re-plan (a fit, a budget change) splits the dense FFNs anew, and where its decode-sized tiers read prepacked
parts (:mod:`vramshard.runtime.cpu_packed`) they were packed at the switch, under the executor's lock: no step
ran meanwhile (llama3-8b's re-plans took 1.0-4.8 s each on an H100 machine, docs/logs-run48). Here a
random-weight model of a real shape cut to ``--layers`` layers, every dense FFN split CPU/GPU on a simulated
GPU (every sub-layer computed on the CPU; parts packed, ``VRAMSHARD_CPU_PACKED=on``), at tiers 1, 16, 64 and 256
(packed at 16 and 64, as a planned engine beside a GPU packs), switches between two splits, each mode to each
split in turn (``--rounds`` 2: each mode once to each):

- ``at_switch``: the switch alone, packing within it: how long the steps stop (ms);
- ``ahead``: :meth:`~vramshard.runtime.executor.Executor.prepare` on a background thread while one-token steps
  run, then the switch: how long the steps stop, how long the packing ahead took, and the steps' median during
  it against before it (what the packing costs the steps instead).

Either way, after the switch, a 200-token prompt twice (``first_prompt_ms``, ``second_prompt_ms``): its chunk is
of the 256-token tier, which packs nothing and reads each FFN's down through a row-major copy, made ahead or in
the first prompt's step.

One process, the same engine throughout; medians over the rounds.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import threading
import time

import torch

from vramshard import Engine
from vramshard.layers.mlp import DenseFFN
from vramshard.models import build_model
from vramshard.plan.placement import CPU, GPU_STREAMED, Placement, TieredPlacement, split_ffn
from vramshard.runtime import cpu_packed
from vramshard.runtime.host_weights import pack_model
from vramshard.shapes import random_weights, shape_config

from .common import hardware, now, rounded, write_json

log = logging.getLogger("pack_ahead")

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
LONG_PROMPT = [(7 * i + 3) % 100 + 1 for i in range(200)]  # a prompt chunk of the 256-token tier
TIERS, PACKED = (1, 16, 64, 256), (False, True, True, False)


def split_plans(model, pieces: int):
    """Every dense FFN's first ``pieces`` pieces on the CPU, the rest streamed, at every tier."""
    def where(s):
        if isinstance(s, DenseFFN):
            return split_ffn(pieces)
        return CPU if s.kind == "embed" else GPU_STREAMED

    placement = Placement(f"split{pieces}", tuple((s.name, where(s)) for s in model))
    return TieredPlacement.every_tier(placement, TIERS, PACKED)


def step_ms(engine, tokens: int, until: threading.Thread | None = None) -> list[float]:
    """Wall ms of each one-token decode step of a greedy stream (the prompt's step left out); with ``until``,
    streams of ``tokens`` tokens until that thread has finished."""
    times = []
    while True:
        last = None
        for _ in engine.stream(PROMPT, max_new_tokens=tokens):
            now_ = time.perf_counter()
            if last is not None:
                times.append((now_ - last) * 1e3)
            last = now_
        if until is None or not until.is_alive():
            return times


def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--pieces", default="5,7", help="CPU pieces of each FFN in the two splits")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=12, help="decode steps measured before each switch")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    mode, cpu_packed.MODE = cpu_packed.MODE, "on"  # (as VRAMSHARD_CPU_PACKED=on: the engine's parts are packed)
    try:
        return _measure(args)
    finally:
        cpu_packed.MODE = mode


def _measure(args) -> dict:
    config = dict(shape_config(args.shape), num_hidden_layers=args.layers)
    model = build_model(config, torch.bfloat16)
    began = time.perf_counter()
    host = pack_model(list(model), random_weights(model), pin=False, splittable=True)
    log.info("%s cut to %d layers: %.2f GiB built in %.1f s", args.shape, args.layers, model.nbytes / 2**30,
             time.perf_counter() - began)
    first, second = (int(p) for p in args.pieces.split(","))
    plans = {first: split_plans(model, first), second: split_plans(model, second)}
    engine = Engine.from_host(model, host, placement=plans[first].placements[0], simulate_gpu=True,
                              max_context=256)
    executor, packed = engine.executor, engine.executor._packed
    executor.reconfigure(plans[first], None)  # (the tiers' packing flags: the plans the switches go between)
    step_ms(engine, 4)  # (warm: kernels, buffers)

    rows = {"at_switch": [], "ahead": []}
    target = second
    for round_ in range(args.rounds):
        for mode in ("at_switch", "ahead") if round_ % 2 == 0 else ("ahead", "at_switch"):  # (each to both splits)
            before = step_ms(engine, args.tokens)
            row = {"round": round_ + 1, "to_pieces": target, "steps_before_ms": statistics.median(before)}
            ahead_before = packed.ahead_s
            if mode == "ahead":
                thread = threading.Thread(target=executor.prepare, args=(plans[target],), name="pack-ahead")
                started = time.perf_counter()
                thread.start()
                during = step_ms(engine, 4, until=thread)
                thread.join()
                row.update(ahead_s=time.perf_counter() - started, ahead_packing_s=packed.ahead_s - ahead_before,
                           steps_during=len(during), steps_during_ms=statistics.median(during) if during else None)
            packing_before = packed.packing_s
            began = time.perf_counter()
            report = executor.reconfigure(plans[target], None)
            row.update(switch_ms=(time.perf_counter() - began) * 1e3, switch_packing_s=packed.packing_s - packing_before,
                       switch_parts_ms={k: v * 1e3 for k, v in report.apply_parts.items()})
            began = time.perf_counter()
            for _ in engine.stream(LONG_PROMPT, max_new_tokens=1):  # its down copies: made ahead, or in this step
                pass
            row["first_prompt_ms"] = (time.perf_counter() - began) * 1e3
            began = time.perf_counter()
            for _ in engine.stream(LONG_PROMPT, max_new_tokens=1):
                pass
            row["second_prompt_ms"] = (time.perf_counter() - began) * 1e3
            log.info("%s: %s", mode, rounded(row))
            rows[mode].append(row)
            target = first if target == second else second

    summary = {mode: {key: statistics.median(r[key] for r in runs)
                      for key in ("switch_ms", "first_prompt_ms", "second_prompt_ms")} for mode, runs in rows.items()}
    ahead = rows["ahead"]
    summary["ahead"].update(ahead_s=statistics.median(r["ahead_s"] for r in ahead),
                            steps_before_ms=statistics.median(r["steps_before_ms"] for r in ahead),
                            steps_during_ms=statistics.median(r["steps_during_ms"] for r in ahead
                                                              if r["steps_during_ms"] is not None))
    result = {"date": now(), "hardware": hardware(), "args": vars(args), "threads": torch.get_num_threads(),
              "model_gib": model.nbytes / 2**30, "rows": rows, "summary": summary}
    log.info("summary: %s", rounded(summary))
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
