"""The planned engine's decode against a baseline's, both loaded at once and stepped in turns: a paired A/B.

    PYTHONPATH=src python -m benchmarks.paired_decode --model llama3-8b --budgets 2,8 [--pps 1024,16] [--rounds 8]
        [--steps 16] [--batch N] [--baseline layers:max] [--profile PATH] [--json out.json] [--simulate]

On the lent GPU hosts the same engine decoded 1.36-1.56x faster or slower from one cell to the next (forty-fourth
GPU session: `layers:17` at 11.63 then 7.47 tok/s a minute apart), so engine_bench's cells, each engine alone for
tens of seconds, compare two engines as much as two moments of the host. Here, per budget, the planned engine and
the baseline are loaded side by side over one pinned copy of the weights (random weights of a real shape), each
warmed up as `vramshard bench` warms it (:func:`vramshard.cli.bench.warm_up`); then for each of ``--pps`` (prompt
lengths) each engine is given one request of that prompt, and ``--rounds`` rounds of ``--steps`` decode steps of
each follow, in the order planned, baseline, then baseline, planned, and so on (ABBA), seconds apart. Each round gives the two engines' median decode step and
its ratio; the host's memory read is measured after every round, and decode's bound (every byte not resident
crossing PCIe or read by the CPU, at once; :func:`benchmarks.common.decode_bound_tok_s`) at that read.

With ``--batch N`` each engine decodes N requests of each prompt length together (``--pps 16 --batch 64``:
engine_bench's batch-64 throughput, paired), and the rounds compare their steps, each of N tokens.

Reported per budget and prompt length: each round's figures, the median and geometric mean of the rounds'
speedups and their range, each engine's median step over all rounds against the bound, and any switch the planned
engine made during the rounds (a fit; the warm-up should have made them all).
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import time

import torch

from vramshard import Engine
from vramshard.cli.bench import BenchSettings, _prompts, warm_up
from vramshard.runtime.host_weights import HostLayouts, pack_model
from vramshard.runtime.wire_codec import wire_ratio
from vramshard.shapes import random_weights, shape_model

from .common import (coded_link, cpu_read_bandwidth, decode_bound_tok_s, h2d_bandwidth, hardware, now, out_dir,
                     shared_read_bandwidth, write_json)
from .engine_bench import MODELS, device_bandwidth, planner_profile

log = logging.getLogger("paired_decode")
GiB = 2**30
SIMULATED_H2D_GB_S = 25.0  # --simulate's nominal PCIe (no GPU to measure)


class Decoding:
    """One engine decoding ``batch`` long requests together (one, by default), a segment of steps at a time:
    each step then makes ``batch`` tokens, one a request."""

    def __init__(self, label: str, engine, settings: BenchSettings, new_tokens: int, prompt_tokens: int | None = None,
                 batch: int = 1):
        self.label, self.engine, self.batch = label, engine, batch
        self.scheduler = engine.scheduler(max_seqs=batch, max_context=settings.max_context,
                                          kv_tokens=settings.kv_tokens, ignore_eos=True)
        prompts = _prompts(batch, prompt_tokens or settings.pp, engine.args.vocab_size, settings.seed)
        self.requests = [self.scheduler.add(prompt, max_new_tokens=new_tokens) for prompt in prompts]
        while any(r.first_token_s is None for r in self.requests) and self.scheduler.has_work:  # the prompts read
            self.scheduler.step()

    def segment(self, steps: int) -> list[float]:
        """Seconds of each of the next ``steps`` decode steps (every request's next token in each)."""
        seconds = []
        for _ in range(steps):
            if not self.scheduler.has_work:
                raise RuntimeError(f"{self.label}: its requests ended early; give them more new tokens")
            self.scheduler.step()
            step = self.scheduler.history[-1]
            if step.decode_tokens != self.batch or step.prefill_tokens:
                raise RuntimeError(f"{self.label}: a step decoded {step.decode_tokens} of its {self.batch} requests "
                                   f"(and read {step.prefill_tokens} prompt tokens): not a step of the batch")
            seconds.append(step.seconds)
        return seconds

    def close(self) -> None:
        for request in self.requests:
            request.cancel()
        while self.scheduler.has_work:
            self.scheduler.step()


def paired_rounds(planned: Decoding, baseline: Decoding, rounds: int, steps: int,
                  read_gb_s=lambda: None) -> list[dict]:
    """``rounds`` rounds of ``steps`` decode steps of each engine, ABBA order; each round's medians (ms), the
    baseline's over the planned's (the speedup), the host's read after it, the planned engine's placements."""
    out = []
    for r in range(rounds):
        order = (planned, baseline) if r % 2 == 0 else (baseline, planned)
        medians = {}
        for decoding in order:
            medians[decoding.label] = statistics.median(decoding.segment(steps)) * 1e3
        out.append({"round": r + 1, "order": [d.label for d in order],
                    "planned_step_ms": medians[planned.label], "baseline_step_ms": medians[baseline.label],
                    "speedup": medians[baseline.label] / medians[planned.label],
                    "host_read_gb_s": read_gb_s(), "planned_plan": planned.engine.executor.plans.name})
    return out


def summary(rounds: list[dict], outside_bytes: int | None, bandwidth: dict | None, batch: int = 1) -> dict:
    """The rounds' speedups (median, geometric mean, range), each engine's median step and its tokens a second
    (``batch`` a step), and at one sequence each engine's median step against decode's bound at the rounds' median
    read (``outside_bytes``: the planned plan's weights not resident)."""
    speedups = [r["speedup"] for r in rounds]
    out = {"rounds": len(rounds), "speedup_median": statistics.median(speedups),
           "speedup_geometric_mean": statistics.geometric_mean(speedups),
           "speedup_min": min(speedups), "speedup_max": max(speedups),
           "rounds_planned_ahead": sum(s > 1 for s in speedups),
           "planned_step_ms_median": statistics.median(r["planned_step_ms"] for r in rounds),
           "baseline_step_ms_median": statistics.median(r["baseline_step_ms"] for r in rounds),
           "planned_plans": sorted({r["planned_plan"] for r in rounds}), "batch": batch}
    out["planned_tok_s"] = batch * 1e3 / out["planned_step_ms_median"]
    out["baseline_tok_s"] = batch * 1e3 / out["baseline_step_ms_median"]
    reads = [r["host_read_gb_s"] for r in rounds if r.get("host_read_gb_s")]
    if reads:
        out["host_read_gb_s_range"] = [min(reads), max(reads)]
    if outside_bytes and bandwidth and reads and batch == 1:
        bound, _ = decode_bound_tok_s(outside_bytes, bandwidth, statistics.median(reads))
        out["decode_bound_tok_s_at_median_read"] = bound
        out["planned_fraction_of_bound"] = 1e3 / out["planned_step_ms_median"] / bound
        out["baseline_fraction_of_bound"] = 1e3 / out["baseline_step_ms_median"] / bound
    return out


def load(model, host: HostLayouts, vram: int, placement: str | None, settings: BenchSettings, profile,
         simulate: bool = False):
    """An engine over the shared host weights (the planned one over their split layout), warmed up.
    ``simulate``: on a simulated GPU (every sub-layer computed on the CPU; a smoke test of the benchmark)."""
    where = {"simulate_gpu": True} if simulate else {"device": "cuda"}
    engine = Engine.from_host(model, host.split if placement is None else host.plain, vram=vram,
                              placement=placement, max_context=settings.max_context, kv_tokens=settings.kv_tokens,
                              profile=profile, **where)
    warm_up(engine, settings)
    return engine


def measured_bandwidth(simulate: bool) -> dict:
    """GB/s of the host-to-device copy, the CPU's read, the GPU's memory and host memory with both readers at
    once; ``simulate``: the CPU's read measured, the rest nominal (no GPU)."""
    if simulate:
        read = cpu_read_bandwidth() / 1e9
        return {"h2d": SIMULATED_H2D_GB_S, "cpu_read": read, "device": 1000.0, "shared_total": read}
    shared = shared_read_bandwidth()
    return {"h2d": h2d_bandwidth() / 1e9, "cpu_read": cpu_read_bandwidth() / 1e9,
            "device": device_bandwidth() / 1e9, "shared_total": shared["total"] / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3-8b", choices=sorted(MODELS))
    parser.add_argument("--budgets", default="2,8", help="GiB, comma-separated")
    parser.add_argument("--baseline", default="layers:max")
    parser.add_argument("--pps", default="1024",
                        help="prompt lengths, comma-separated: rounds at about each one's context, in turn "
                             "(\"1024,16\": the 1K context and a short chat's)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=16, help="decode steps of each engine a round")
    parser.add_argument("--batch", type=int, default=1,
                        help="requests each engine decodes together (e.g. 64 with --pps 16: the batched "
                             "throughput of engine_bench's batch 64, paired); the rounds compare their steps")
    parser.add_argument("--profile", default=None, help="machine profile for the planner")
    parser.add_argument("--layers", type=int, default=None, help="cut the model to N layers")
    parser.add_argument("--simulate", action="store_true",
                        help="a smoke test without a GPU: both engines on a simulated GPU, a synthetic profile "
                             "(the figures say nothing of a real machine)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if not args.simulate and not torch.cuda.is_available():
        raise SystemExit("paired_decode needs a CUDA GPU (--simulate: a smoke test on the CPU)")
    pps = [int(pp) for pp in args.pps.split(",") if pp]
    new_tokens = args.rounds * args.steps + 8
    if args.batch < 1:
        raise SystemExit(f"--batch must be at least 1, got {args.batch}")
    if args.batch == 1:
        # (tg: the decode a request runs; the warm-up reads the longest prompt, then the shortest at batch 1)
        settings = BenchSettings(max(pps), new_tokens, (1,), min(pps) if len(pps) > 1 else 16, 16)
    else:  # (KV for the batch's requests at the longest prompt; the warm-up runs the batch's shape)
        settings = BenchSettings(max(pps), new_tokens, (args.batch,), max(pps), new_tokens)
    bandwidth = measured_bandwidth(args.simulate)
    if args.simulate:
        from vramshard.profile.query import synthetic

        profile, profile_source = synthetic(cpu_gflops=200, gpu_gflops=20_000, h2d_gbps=SIMULATED_H2D_GB_S,
                                            cpu_mem_gbps=bandwidth["cpu_read"]), "synthetic (--simulate)"
    else:
        profile, profile_source = planner_profile(args.profile, bandwidth, {MODELS[args.model]})
    model = shape_model(args.model, MODELS[args.model])
    if args.layers:
        from vramshard.models import build_model
        from vramshard.shapes import shape_config

        config = shape_config(args.model)
        config["num_hidden_layers"] = args.layers
        model = build_model(config, MODELS[args.model])
    host = HostLayouts(list(model), pack_model(list(model), random_weights(model), pin=not args.simulate,
                                               splittable=False))
    results = {"date": now(), "hardware": hardware(), "args": vars(args), "simulated": args.simulate,
               "bandwidth_gb_s": bandwidth,
               "profile": profile_source, "model_bytes": model.nbytes, "budgets": {}}
    target = args.json or out_dir() / "paired_decode.json"
    for budget in [b for b in args.budgets.split(",") if b]:
        vram = int(float(budget) * GiB)
        planned = load(model, host, vram, None, settings, profile, args.simulate)
        baseline = load(model, host, vram, args.baseline, settings, profile, args.simulate)
        entry = results["budgets"][f"{budget}GiB"] = {
            "planned_placement": planned.executor.plans.name, "baseline_placement": baseline.executor.plans.name,
            "prompts": {}}
        for pp in pps:  # (one pair of requests at a time: each engine's KV pool holds one)
            events_before = len(planned.budget.events)
            pair = [Decoding("vramshard", planned, settings, new_tokens, pp, args.batch),
                    Decoding(args.baseline, baseline, settings, new_tokens, pp, args.batch)]
            began = time.perf_counter()
            rounds = paired_rounds(*pair, args.rounds, args.steps, read_gb_s=lambda: cpu_read_bandwidth() / 1e9)
            entry["prompts"][str(pp)] = {
                "rounds": rounds, "seconds": time.perf_counter() - began,
                "planned_switches_in_rounds": [e.get("why") for e in list(planned.budget.events)[events_before:]],
                "summary": summary(rounds, model.nbytes - planned.executor.resident_weight_bytes,
                                   coded_link(bandwidth, wire_ratio(model.dtype)), args.batch)}
            for decoding in pair:
                decoding.close()
            # (engine_bench's cell line: gpu_session/switches_after_warmup.py ends a cell at it)
            log.info("%s vramshard %d: %s", args.model, vram,
                     {"placement": planned.executor.plans.name, "pp": pp, **entry["prompts"][str(pp)]["summary"]})
            write_json(target, results)
        entry["peak_vram_bytes"] = {"vramshard": planned.executor.peak_vram(),
                                    args.baseline: baseline.executor.peak_vram()}
        del pair, planned, baseline
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    write_json(target, results)
    log.info("written to %s", target)


if __name__ == "__main__":
    main()
