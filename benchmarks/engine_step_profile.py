"""Where the engine's batched decode step spends its time: the real engine path (scheduler, paged
KV cache, the planned engine after its calibration) under torch.profiler.

    PYTHONPATH=src python -m benchmarks.engine_step_profile --shape llama3-8b --budget 8 --seqs 64 \\
        --profile docs/profiles/h200-queued.json --json $OUT/engine_steps.json
    PYTHONPATH=src python -m benchmarks.engine_step_profile --shape tiny-llama --device cpu --seqs 4   # smoke test

``benchmarks.step_profile`` times an executor on a hand-made step; this builds the engine as
``engine_bench`` does, warms it as the bench does (each batch size once, the calibration's
re-plan waited for), then runs ``--seqs`` prompts of ``--prompt`` tokens and profiles ``--steps``
of their decode steps. Per step it prints the engine's own split (forward, the host computing CPU
work, the host waiting for the GPU for it, the rest of the forward, and the step outside the
forward) and the operators with the most host and device time. ``--placement`` profiles a named
placement instead of the plan (``layers:max`` is the bench's baseline).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from vramshard.cli.bench import BenchSettings, _prompts, warm_up
from vramshard.engine import Engine
from vramshard.runtime.host_weights import HostLayouts, pack_model
from vramshard.shapes import random_weights, shape_model

from .common import hardware, now, write_json
from .step_profile import top

log = logging.getLogger("engine_step_profile")
GiB = 2**30


def bench_settings(args) -> BenchSettings:
    """The bench's settings for one batch of ``--seqs`` prompts (its warm-up and KV sizes)."""
    return BenchSettings(pp=args.prompt, tg=args.steps + 4, batch_sizes=(args.seqs,), batch_prompt=args.prompt,
                         batch_gen=max(10, args.steps + 4), time_limit_s=10.0)


def build_engine(args, settings: BenchSettings) -> Engine:
    model = shape_model(args.shape)
    gpu = args.device == "cuda"
    t0 = time.perf_counter()
    host = HostLayouts(list(model), pack_model(list(model), random_weights(model), pin=gpu, splittable=False))
    log.info("%s (%.1f GiB) built in %.1f s", args.shape, model.nbytes / GiB, time.perf_counter() - t0)
    placement = None if args.placement == "planned" else args.placement
    weights = host.split if placement is None and gpu else host.plain
    profile = None
    if args.profile:
        from vramshard.profile import load

        profile = load(args.profile, check_fingerprint=False)
    vram = int(args.budget * GiB) if args.budget and args.device == "cuda" else None
    return Engine.from_host(model, weights, vram=vram, device=args.device, placement=placement,
                            max_context=settings.max_context, kv_tokens=settings.kv_tokens, profile=profile)


def profile_decode(engine: Engine, args, settings: BenchSettings) -> dict:
    """Run ``args.seqs`` prompts, profile ``args.steps`` of their decode steps after two unprofiled ones."""
    vocab = engine.args.vocab_size
    scheduler = engine.scheduler(max_seqs=args.seqs, max_context=settings.max_context, kv_tokens=settings.kv_tokens,
                                 ignore_eos=True)
    requests = [scheduler.add(p, max_new_tokens=args.steps + 3) for p in _prompts(args.seqs, args.prompt, vocab, 7)]
    while any(r.first_token_s is None for r in requests):
        scheduler.step()
    for _ in range(2):
        scheduler.step()
    first = len(scheduler.history)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            scheduler.step()
        if args.device == "cuda":
            torch.cuda.synchronize()
    steps = [s for s in list(scheduler.history)[first:] if s.prefill_tokens == 0]
    for request in requests:
        request.cancel()

    def median_ms(values) -> float:
        return 1e3 * statistics.median(values)

    result = {
        "steps": len(steps),
        "rows": statistics.median(s.decode_tokens for s in steps),
        "step_ms": median_ms(s.seconds for s in steps),
        "forward_ms": median_ms(s.forward_s for s in steps),
        "host_compute_ms": median_ms(s.host_compute_s for s in steps),
        "host_wait_ms": median_ms(s.host_wait_s for s in steps),
        "forward_other_ms": median_ms(s.forward_s - s.host_compute_s - s.host_wait_s for s in steps),
        "outside_forward_ms": median_ms(s.seconds - s.forward_s for s in steps),
    }
    averages = prof.key_averages()
    result["top_host"] = top(averages, "self_cpu_time_total", args.rows)
    if args.device == "cuda":
        result["top_device"] = top(averages, "self_device_time_total", args.rows)
    if args.trace:
        path = f"{args.trace}/engine_trace_{args.placement.replace(':', '-')}.json"
        prof.export_chrome_trace(path)
        result["trace"] = path
    return result


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--budget", type=float, default=8.0, help="VRAM budget in GiB (0: none)")
    parser.add_argument("--placement", default="planned", help="planned, or a named placement (layers:max, gpu, ...)")
    parser.add_argument("--seqs", type=int, default=64, help="sequences decoding together (the batch)")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens of each sequence")
    parser.add_argument("--steps", type=int, default=4, help="decode steps profiled")
    parser.add_argument("--profile", default=None, help="machine profile for the planner")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", type=int, default=15, help="operators listed by host and by device time")
    parser.add_argument("--trace", default=None, help="folder for a chrome trace")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: use --device cpu (with a small --shape) for a smoke test")
    settings = bench_settings(args)
    engine = build_engine(args, settings)
    log.info("engine: %s", engine.executor.plans.name)
    warm_up(engine, settings)  # on a GPU: graphs captured, the calibration fitted and re-planned
    result = {"date": now(), "hardware": hardware(), "args": vars(args), "placement": engine.executor.plans.name,
              "calibrations": list(engine.budget.calibrations) if engine.plan is not None else []}
    with torch.inference_mode():
        result.update(profile_decode(engine, args, settings))
    log.info("%s", {k: round(v, 2) if isinstance(v, float) else v for k, v in result.items()
                    if k not in ("top_host", "top_device", "hardware", "args", "calibrations")})
    for key in ("top_host", "top_device"):
        for entry in result.get(key, []):
            log.info("  %-9s %10.0f us %6d  %s", key[4:], entry["us"], entry["calls"], entry["name"])
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
