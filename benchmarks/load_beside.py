"""Decode while other work takes cores beside the engine and lets them go: a game starting and stopping.

    PYTHONPATH=src python -m benchmarks.load_beside --shape llama3-8b --budget 8 --burn 6 --phase-s 30 \
        --profile docs/profiles/h100-run40.json --out $OUT/load_beside.json

One planned engine over random weights of the shape's real size, twice in one process: the engine as it
is (it judges its CPU work again when the cores busy beside it change for good: runtime/host_load.py),
then with that off (``VRAMSHARD_FOLLOW_HOST_LOAD=off``: its CPU work fitted once). Each first decodes
until its own fits' plans are in force (at most ``--settle-s``; in the thirty-eighth GPU session the two
engines met the load on different plans), then decodes one
sequence from a 1K prompt through three phases of ``--phase-s``: quiet; ``--burn`` processes that each
keep a core busy reading memory (a game's threads); quiet again. Reported per phase and engine: tok/s over
the phase's second half (after the engine had time to follow: tokens generated over the time of the
``generate`` calls of ``--chunk`` tokens, each of which reads the prompt again, a 1K prompt's ~0.2 s beside
a 64-token call's ~5 s at 8 GiB), the engine's load readings (the cores busy beside it, and those wanted),
its load changes and fits, the plan at the end of the phase. The bound of each phase: the bytes a decode
step reads (:func:`~benchmarks.common.decode_read_bytes`) less those resident in VRAM, over (host→device +
the CPU's read of host memory measured in that phase's load)
— the burners slow the CPU's read, which is what the engine has to follow.

The burners are processes (no GIL shared with the engine) that sum a 64 MiB array in a loop.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import time

import torch

from vramshard.cli.bench import load_host
from vramshard.runtime import host_load

from .common import (cpu_read_bandwidth, decode_read_bytes, h2d_bandwidth, hardware, now, out_dir, scaled_to_this_host,
                     write_json)

log = logging.getLogger("load_beside")
GiB = 2**30


def _burn(stop) -> None:
    """Keep one core busy reading memory until ``stop`` is set."""
    torch.set_num_threads(1)
    data = torch.ones(16 * 2**20)  # 64 MiB: beyond the caches
    while not stop.is_set():
        data.sum()


class Burners:
    """``count`` burner processes while in the ``with`` block."""

    def __init__(self, count: int):
        self.count = count
        self.context = multiprocessing.get_context("spawn")
        self.stop = self.context.Event()
        self.processes = []

    def __enter__(self):
        self.processes = [self.context.Process(target=_burn, args=(self.stop,), daemon=True) for _ in range(self.count)]
        for process in self.processes:
            process.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for process in self.processes:
            process.join(10)
            if process.is_alive():
                process.kill()


def decode_phase(engine, prompt: list[int], seconds: float, chunk: int) -> dict:
    """Decode ``chunk`` tokens at a time (one sequence, the prompt again each time) for ``seconds``;
    tok/s over the second half, the engine's load readings and changes seen meanwhile."""
    began = time.perf_counter()
    windows = []  # (end time from began, tokens, seconds)
    readings, wanted = [], []
    while time.perf_counter() - began < seconds:
        start = time.perf_counter()
        out = engine.generate([prompt], chunk)
        windows.append((time.perf_counter() - began, len(out[0]), time.perf_counter() - start))
        stats = engine.cpu_stats()
        readings.append(stats["other_cores_busy"])
        wanted.append(stats["other_cores_wanted"])
    late = [(tokens, spent) for end, tokens, spent in windows if end > seconds / 2]
    tokens = sum(t for t, _ in late)
    spent = sum(s for _, s in late)
    return {"tok_s_second_half": tokens / spent if spent else None,
            "tok_s_all": sum(t for _, t, _ in windows) / max(sum(s for _, _, s in windows), 1e-9),
            "other_cores_readings": [r for r in readings if r is not None],
            "other_cores_wanted": [r for r in wanted if r is not None],
            "plan_at_end": engine.executor.plans.name}


def settle(engine, prompt: list[int], seconds: float, chunk: int) -> float:
    """Decode until the engine's own fits are made and their plans are in force (no tier's CPU work left
    to judge, no plan awaited), for at most ``seconds``: both engines then meet the phases on the plans
    their fits chose, not halfway. Returns the seconds it took."""
    began = time.perf_counter()
    follower = engine.budget
    while time.perf_counter() - began < seconds and (engine.calibration_pending() or follower.refine is not None
                                                      or follower.background.busy):
        engine.generate([prompt], chunk)
    return time.perf_counter() - began


def run_engine(model, host, args, profile, follow: bool, outside_bytes_of) -> dict:
    from vramshard.engine import Engine

    host_load.ENABLED = follow  # (read when the engine's budget follower is made)
    gpu = args.device == "cuda"
    engine = Engine.from_host(model, host.split if gpu else host.plain, vram=int(args.budget * GiB) if gpu else None,
                              device=args.device, max_context=args.prompt + 1024, profile=profile)
    prompt = [(7 * i) % (model.args.vocab_size - 1) + 1 for i in range(args.prompt)]
    engine.generate([prompt], 8)  # (the first calls of each shape)
    result = {"follow_host_load": follow, "plan_at_load": engine.executor.plans.name, "phases": []}
    result["settle_s"] = settle(engine, prompt, args.settle_s, args.chunk)
    result["plan_settled"] = engine.executor.plans.name
    for name, burn in (("quiet", 0), ("burning", args.burn), ("quiet again", 0)):
        with Burners(burn):
            time.sleep(0.5)
            torch.set_num_threads(args.threads)  # (the engine sets its own before each step)
            read = cpu_read_bandwidth()  # (the CPU's read on all threads with the burners at work)
            phase = decode_phase(engine, prompt, args.phase_s, args.chunk)
        outside = outside_bytes_of(engine)
        phase.update(name=name, burners=burn, cpu_read_gb_s=read / 1e9,
                     bound_tok_s=(args.h2d + read) / outside if outside else None)
        phase["load_changes"] = list(engine.budget.load_changes)
        phase["calibrations"] = len(engine.budget.calibrations)
        log.info("%s, following %s: %s", name, follow,
                 {k: v for k, v in phase.items() if k not in ("other_cores_readings", "other_cores_wanted")})
        result["phases"].append(phase)
    del engine
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--layers", type=int, default=None, help="cut the model to N layers")
    parser.add_argument("--budget", type=float, default=8.0, help="GiB")
    parser.add_argument("--burn", type=int, default=6, help="burner processes in the middle phase")
    parser.add_argument("--phase-s", type=float, default=30.0)
    parser.add_argument("--chunk", type=int, default=64, help="tokens per generate call")
    parser.add_argument("--settle-s", type=float, default=30.0,
                        help="at most this long decoding before the phases, until the engine's fits are in force")
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--profile", default=None)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test of the script")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from vramshard.profile import load

    model, host, _ = load_host(None, args.shape, None, args.layers, pin=args.device == "cuda")
    profile, source = scaled_to_this_host(load(args.profile, check_fingerprint=False), args.profile, model.dtype) \
        if args.profile else (None, "stored")
    args.h2d = h2d_bandwidth() if args.device == "cuda" else 0.0
    args.threads = torch.get_num_threads()
    read = decode_read_bytes(model, args.prompt)  # (a step's weights but the embedding's gathered rows, its KV)

    def outside_bytes_of(engine) -> int:
        return max(read - engine.executor.need.resident, 1)

    results = [run_engine(model, host, args, profile, follow, outside_bytes_of) for follow in (True, False)]
    out = {"date": now(), "hardware": hardware(), "args": vars(args), "profile": source, "h2d_gb_s": args.h2d / 1e9,
           "cores": os.cpu_count(), "engines": results}
    write_json(args.out or out_dir() / "load_beside.json", out)


if __name__ == "__main__":
    main()
