"""Sharing the GPU: vramshard generates while another program takes VRAM and gives it back.

A separate process (multiprocessing, spawn) plays the other application: it allocates and frees
VRAM in a pattern (default 0 -> 10 GiB -> 4 GiB -> 0, each held ``--hold`` seconds). Meanwhile
vramshard generates greedily with a budget that follows it:

  auto  the engine reads the free VRAM (NVML, else torch) of a virtual card of ``--gpu-size``
        (the real card's free VRAM less what the card had in use before the demo started), less
        a margin, at step boundaries, as ``--vram auto`` does on a client GPU of that size;
  set   the driver calls ``engine.set_vram`` at each phase change (a cooperative application).

Both processes sample their VRAM (torch.cuda.memory_reserved; NVML per process when available)
over time, vramshard's from a thread of its own so that re-plans are sampled too, and the
engine's tokens/s after its steps. ``time_over_card_s`` is how long both together held more than
the virtual card. Then the same prompts run undisturbed (fixed budget) and the greedy tokens are
compared. Writes budget_demo.json and budget_demo.png to $OUT.

    python benchmarks/budget_demo.py --shape llama3-8b --gpu-size 16GiB --pattern 0,10,4,0 --hold 20
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing as mp
import os
import threading
import time

import torch

from vramshard import Engine
from vramshard.runtime import budget as budgets
from vramshard.runtime.host_weights import pack_model
from vramshard.shapes import random_weights, shape_model
from vramshard.units import format_bytes, parse_size

try:
    from common import hardware, out_dir, versions, write_json
except ImportError:  # run as a module
    from benchmarks.common import hardware, out_dir, versions, write_json

GiB = 2**30
log = logging.getLogger("budget_demo")


# ---------------------------------------------------------------------- the other application
def other_app(pattern_gib: list[float], hold_s: float, ready, start, samples, sample_s: float) -> None:
    """Allocate ``pattern_gib[i]`` GiB for ``hold_s`` seconds each, sampling its own VRAM.

    Times are wall-clock seconds (``time.time()``): the driver puts them on its own time axis.
    ``ready`` is set once CUDA is up here, so that the pattern starts when ``start`` is set,
    not after this process has initialized CUDA (seconds, which shifted the two time axes).
    """
    torch.cuda.init()
    torch.empty(1, device="cuda")  # the CUDA context exists before the pattern starts
    ready.set()
    start.wait()
    held: list[torch.Tensor] = []
    rows = []
    for phase, gib in enumerate(pattern_gib):
        rows.append({"t": time.time(), "event": "phase start", "phase": phase, "gib": gib})
        target = int(gib * GiB)
        now = sum(t.numel() for t in held)
        while now > target and held:  # free, and give it back to the card (not just to torch's cache)
            now -= held.pop().numel()
        torch.cuda.empty_cache()
        while now < target:  # allocate in 256 MiB blocks, touched so the memory is real
            block = torch.empty(min(256 * 2**20, target - now), dtype=torch.uint8, device="cuda")
            block.fill_(1)
            held.append(block)
            now += block.numel()
        torch.cuda.synchronize()
        rows.append({"t": time.time(), "event": "phase", "phase": phase, "gib": gib})
        end = rows[-2]["t"] + hold_s
        while time.time() < end:
            rows.append({"t": time.time(), "reserved": torch.cuda.memory_reserved(),
                         "nvml": budgets.process_vram(os.getpid())})
            time.sleep(sample_s)
    held.clear()
    torch.cuda.empty_cache()
    samples.put(rows)


# ---------------------------------------------------------------------- vramshard's side
def virtual_card(gpu_size: int, baseline_used: int):
    """(free, total) of a card of ``gpu_size`` bytes: the real card's use beyond ``baseline_used``
    (what was in use before the demo) counts against it.

    The free bytes go negative when the other application took more than the virtual card had
    left (the real card is larger, so its allocation succeeded). On a real card of that size the
    driver would have had to evict this process's memory; the budget then drops by the whole
    excess at once (free + held - margin) rather than by the margin per poll.
    """
    def read():
        free, total = budgets.free_vram("cuda")
        used = max(0, total - free - baseline_used)
        return gpu_size - used, gpu_size
    return read


@contextlib.contextmanager
def vram_sampler(t0: float, interval_s: float):
    """While inside: a thread samples this process's VRAM every ``interval_s`` (reserved bytes, and
    NVML's count when available), also while a step or a re-plan holds the generating thread."""
    rows, stop = [], threading.Event()

    def run() -> None:
        while not stop.wait(interval_s):
            rows.append({"t": time.time() - t0, "reserved": torch.cuda.memory_reserved(),
                         "nvml": budgets.process_vram(os.getpid())})

    thread = threading.Thread(target=run, name="vram-sampler", daemon=True)
    thread.start()
    try:
        yield rows
    finally:
        stop.set()
        thread.join()


def generate_under_pattern(engine, prompts, args, start, pattern_s: float):
    """Step a scheduler through the pattern; returns (outputs, samples at step ends, VRAM samples of a
    thread of their own, t0: the wall time it began)."""
    scheduler = engine.scheduler(max_seqs=len(prompts), max_context=args.context, ignore_eos=True)
    requests = [scheduler.add(p, max_new_tokens=args.context - len(p)) for p in prompts]
    samples = []
    t0 = time.time()
    with vram_sampler(t0, args.sample / 2) as vram:
        start.set()
        outputs = _generate(engine, scheduler, requests, samples, args, t0, pattern_s)
    return outputs, samples, vram, t0


def _generate(engine, scheduler, requests, samples, args, t0: float, pattern_s: float) -> list[list[int]]:
    """Step until the pattern has played (or the requests end), sampling tok/s and the budget."""
    phase_at = [i * args.hold for i in range(len(args.pattern))]
    next_phase = 0
    last = (t0, 0)
    while time.time() - t0 < pattern_s and scheduler.has_work:
        elapsed = time.time() - t0
        if args.mode == "set" and next_phase < len(phase_at) and elapsed >= phase_at[next_phase]:
            engine.set_vram(max(0, args.gpu_size - int(args.pattern[next_phase] * GiB) - args.margin))
            next_phase += 1
        scheduler.step()
        now = time.time()
        generated = scheduler.total_generated_tokens
        if now - last[0] >= args.sample:
            samples.append({"t": now - t0, "tok_s": (generated - last[1]) / (now - last[0]),
                            "reserved": torch.cuda.memory_reserved(), "budget": engine.budget_watcher.in_force,
                            "planned": engine.executor.need.total, "kv_on_gpu": bool(engine.executor.kv_layers_on_gpu),
                            "nvml": budgets.process_vram(os.getpid())})
            last = (now, generated)
    for request in requests:
        request.cancel()
    scheduler.run_until_idle()
    return [list(r.output_ids) for r in requests]


def is_budget_change(event: dict) -> bool:
    """An adaptation to a budget change, not a full plan that followed one ("refine") or a re-plan
    after the engine fitted its profile to its steps ("calibrate")."""
    return event["why"] not in ("refine", "calibrate")


def reactions(theirs: list[dict], events: list[dict], t0: float) -> list[dict]:
    """Per phase of the other application: when it began taking or giving back VRAM, and when
    vramshard's VRAM had followed (the first adaptation after it: its release, on the same clock).

    An adaptation event is recorded when the executor's reconfiguration ends (``time``); its VRAM
    was released ``adapt_s - release_s`` before that. A budget that grew is deferred (nothing to
    release); ``full_plan_in_force_s`` is when its full plan, made in the background, came in.
    """
    starts = [r for r in theirs if r.get("event") == "phase start"]
    out = []
    for i, phase in enumerate(starts):
        until = starts[i + 1]["t"] if i + 1 < len(starts) else float("inf")
        after = [e for e in events if is_budget_change(e) and phase["t"] <= e["time"] < until]
        row = {"phase": phase["phase"], "gib": phase["gib"], "t": phase["t"] - t0}
        if after:
            first = after[0]
            released = first["time"] - first["adapt_s"] + first["release_s"]
            row.update(reaction_s=released - phase["t"], budget=first["budget"],
                       engine_release_s=first["time_to_release_s"])
            if first.get("deferred"):  # a grown budget: its full plan came into force later, as a refine
                done = [e for e in events if e["why"] == "refine" and first["time"] <= e["time"] < until]
                if done:
                    row["full_plan_in_force_s"] = done[0]["time"] - phase["t"]
        out.append(row)
    return out


def time_over_the_card(vram: list[dict], crowded: list[float]) -> float:
    """Seconds the over-the-card samples ``crowded`` stand for: each, until our next VRAM sample."""
    times = sorted(s["t"] for s in vram)
    over = set(crowded)
    return sum(b - a for a, b in zip(times, times[1:]) if a in over)


def over_the_card(ours: list[dict], theirs: list[dict], gpu_size: int) -> list[float]:
    """Times of our samples at which both processes together held more than the virtual card:
    the other application's VRAM is its latest sample before ours (its CUDA context included,
    as NVML counts it; else its reserved bytes)."""
    mine = sorted((s["t"], s["nvml"] if s.get("nvml") else s["reserved"]) for s in ours)
    other = sorted((r["t"], r["nvml"] if r.get("nvml") else r["reserved"]) for r in theirs if "reserved" in r)
    times, j, held = [], 0, 0
    for t, used in mine:
        while j < len(other) and other[j][0] <= t:
            held = other[j][1]
            j += 1
        if used + held > gpu_size:
            times.append(t)
    return times


def undisturbed_run(engine, prompts, counts, context: int) -> list[list[int]]:
    """The same prompts batched as in the disturbed run, each for as many tokens as it got there."""
    scheduler = engine.scheduler(max_seqs=len(prompts), max_context=context, ignore_eos=True)
    requests = [scheduler.add(p, max_new_tokens=n) if n else None for p, n in zip(prompts, counts)]
    scheduler.run_until_idle()
    return [list(r.output_ids) if r is not None else [] for r in requests]


def plot(path, ours, vram, theirs, events, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    top.plot([s["t"] for s in vram], [s["reserved"] / GiB for s in vram], label="vramshard reserved")
    top.step([s["t"] for s in ours], [(s["budget"] or 0) / GiB for s in ours], where="post", label="budget in force")
    top.plot([s["t"] for s in theirs if "reserved" in s], [s["reserved"] / GiB for s in theirs if "reserved" in s],
             label="other application")
    top.axhline(args.gpu_size / GiB, color="grey", linestyle=":", label="virtual card")
    for event in events:
        top.axvline(event["t"], color="red", alpha=0.2)
    top.set_ylabel("VRAM (GiB)")
    top.legend(loc="upper right", fontsize=8)
    bottom.plot([s["t"] for s in ours], [s["tok_s"] for s in ours])
    bottom.set_ylabel("tokens/s")
    bottom.set_xlabel("seconds")
    fig.suptitle(f"{args.shape}, {args.mode} budget, other app {args.pattern} GiB x {args.hold:.0f} s")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--gpu-size", default="16GiB", help="the virtual client card (default 16GiB)")
    parser.add_argument("--pattern", default="0,10,4,0", help="GiB the other application holds, phase by phase")
    parser.add_argument("--hold", type=float, default=20.0, help="seconds per phase (default 20)")
    parser.add_argument("--mode", choices=("auto", "set"), default="auto")
    parser.add_argument("--margin", default="512MiB")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--sample", type=float, default=0.25, help="seconds between samples")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="weights dtype (default float32: re-planning moves sub-layers between the CPU and "
                             "the GPU, whose bf16/fp16 kernels round differently, so only float32 can keep greedy "
                             "tokens identical to an undisturbed run)")
    args = parser.parse_args()
    args.pattern = [float(x) for x in args.pattern.split(",")]
    args.gpu_size, args.margin = parse_size(args.gpu_size), parse_size(args.margin)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("budget_demo needs a CUDA GPU")

    model = shape_model(args.shape, getattr(torch, args.dtype))
    host = pack_model(list(model), random_weights(model), pin=True)
    torch.cuda.empty_cache()  # the weights were generated on the GPU: give that memory back to the card
    free, total = budgets.free_vram("cuda")
    baseline_used = total - free
    start_budget = args.gpu_size - args.margin
    engine = Engine.from_host(model, host, name=args.shape, vram=start_budget, device="cuda",
                              max_context=args.context, max_batch=args.batch, max_step_tokens=256)
    if args.mode == "auto":
        engine.budget_watcher.set_source(budgets.AutoBudget(margin=args.margin, min_interval_s=0.2,
                                                            reader=virtual_card(args.gpu_size, baseline_used)))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.args.vocab_size, (args.prompt_len,), generator=g).tolist()
               for _ in range(args.batch)]

    ctx = mp.get_context("spawn")
    ready, start, samples = ctx.Event(), ctx.Event(), ctx.Queue()
    other = ctx.Process(target=other_app, args=(args.pattern, args.hold, ready, start, samples, args.sample))
    other.start()
    if not ready.wait(120):
        raise SystemExit("the other application did not start CUDA within 120 s")
    engine.poll_budget()  # its CUDA context is on the card now: the budget in force counts it
    pattern_s = args.hold * len(args.pattern) + 2
    disturbed, ours, vram, t0 = generate_under_pattern(engine, prompts, args, start, pattern_s)
    theirs = samples.get(timeout=120)
    other.join(30)
    events = list(engine.budget_events)  # before the undisturbed run's own budget change
    reacted = reactions(theirs, events, t0)
    crowded = over_the_card(vram, [{**r, "t": r["t"] - t0} for r in theirs], args.gpu_size)
    theirs = [{**r, "t": r["t"] - t0} for r in theirs]  # on our time axis

    engine.set_vram(start_budget)  # undisturbed: the same prompts under the starting budget
    engine.budget_watcher.set_source(budgets.SettableBudget(start_budget))
    engine.poll_budget()
    counts = [len(o) for o in disturbed]
    undisturbed = undisturbed_run(engine, prompts, counts, args.context)
    first_diff = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
                  for x, y in zip(disturbed, undisturbed)]
    over = [s for s in ours if s["budget"] is not None and s["reserved"] > s["budget"] + 256 * 2**20]
    result = {
        "hardware": hardware(), "versions": versions(), "args": {k: v for k, v in vars(args).items()},
        "tokens_identical": disturbed == undisturbed, "tokens_generated": counts, "first_difference": first_diff,
        "adaptations": events,  # budget changes, and "refine": a full plan after a quick one
        "time_to_release_s": [e["time_to_release_s"] for e in events if is_budget_change(e)],
        # From the other application's phase start (its first allocation or free) to our VRAM released.
        "reactions": reacted,
        "samples_over_budget": len(over),  # our reserved VRAM above the budget in force
        "samples_over_card": crowded,  # times both processes together held more than the virtual card
        "time_over_card_s": time_over_the_card(vram, crowded),
        "ours": ours, "vram": vram, "theirs": theirs,
    }
    out = out_dir()
    write_json(out / "budget_demo.json", result)
    plot(out / "budget_demo.png", ours, vram, theirs,
         [{"t": s["t"]} for s in theirs if s.get("event") == "phase start"], args)
    log.info("tokens identical: %s; %d adaptations, time to release VRAM %s (engine side); samples over budget: %d",
             result["tokens_identical"], len(result["time_to_release_s"]),
             ", ".join(f"{t * 1e3:.0f} ms" for t in result["time_to_release_s"]), len(over))
    log.info("reaction from the other application's phase start to our VRAM released: %s; samples over the card "
             "(both processes): %d, %.2f s in all", ", ".join(f"phase {r['phase']} ({r['gib']:g} GiB) {r['reaction_s']:.2f} s"
                                                        for r in reacted if "reaction_s" in r),
             len(crowded), result["time_over_card_s"])
    log.info("peak VRAM of vramshard %s", format_bytes(engine.executor.peak_vram()))
    return 0 if result["tokens_identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
