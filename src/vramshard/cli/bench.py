"""``vramshard bench``: llama-bench-style speed of the planned engine and of placement baselines.

    vramshard bench MODEL --vram 4GiB                      # planned engine + layers:max and cpu baselines
    vramshard bench --shape nemo-8b --vram 2GiB --json out.json --png out.png
    vramshard bench --shape tiny-llama --pp 64 --tg 16     # seconds on a CPU

Measured for each engine, all in the same run and on one host copy of the weights:
  pp     prompt tokens/s of a ``--pp``-token prompt (= pp / time to first token);
  tg     generation tokens/s of ``--tg`` tokens after that prompt (decode at that context);
  TTFT   time to first token; e2e: the whole request;
  bN     batched throughput: N prompts of ``--batch-prompt`` tokens, ``--batch-gen`` new tokens each,
         generated tokens / wall time (prompts included), for N in ``--batch-sizes``;
  sched  Python time per step outside the forward pass (scheduling, sampling, streaming).
With ``--shape`` the model is a named real shape (``vramshard.shapes``) with random weights built
in memory: nothing is downloaded, and speed does not depend on weight values.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from ..errors import InvalidInputError, VramshardError
from ..runtime.kv_cache import DEFAULT_BLOCK_SIZE
from ..runtime.timeline import Timeline
from ..units import format_bytes
from .common import add_threads_arg

log = logging.getLogger(__name__)
DEFAULT_BATCHES = (1, 4, 16, 64)


@dataclass
class BenchSettings:
    """What to measure (token counts of the tests)."""

    pp: int = 512
    tg: int = 128
    batch_sizes: tuple[int, ...] = DEFAULT_BATCHES
    batch_prompt: int = 32
    batch_gen: int = 32
    repeat: int = 1
    seed: int = 0
    time_limit_s: float | None = None  # decode time limit of one run (see _over_limit); rates from what it made

    def __post_init__(self):
        counts = (self.pp, self.tg, self.batch_prompt, self.batch_gen, self.repeat, *self.batch_sizes)
        if not self.batch_sizes or any(not isinstance(n, int) or n < 1 for n in counts):
            raise InvalidInputError(f"bench sizes must be whole numbers >= 1, got pp={self.pp} tg={self.tg} "
                                    f"batch sizes {self.batch_sizes} batch prompt {self.batch_prompt} "
                                    f"batch gen {self.batch_gen} repeat {self.repeat}")

    @property
    def max_context(self) -> int:
        """Longest sequence a test runs."""
        return max(self.pp + self.tg, self.batch_prompt + self.batch_gen)

    @property
    def kv_tokens(self) -> int:
        """KV positions the engine must reserve: the largest batch at once, or the pp+tg request."""
        def blocks(n: int) -> int:
            return -(-n // DEFAULT_BLOCK_SIZE) * DEFAULT_BLOCK_SIZE
        return max(blocks(self.pp + self.tg), max(self.batch_sizes) * blocks(self.batch_prompt + self.batch_gen))


@dataclass
class EngineSpec:
    """One engine of the comparison: ``placement`` None is the planned engine."""

    label: str
    placement: str | None = None
    vram: str | int | None = None
    options: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------- measuring
def _prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count, length), generator=generator).tolist()


def run_requests(engine, prompts: list[list[int]], new_tokens: int, settings: BenchSettings) -> dict:
    """Run ``prompts`` together through a fresh scheduler (EOS ignored); timings of the run."""
    scheduler = engine.scheduler(max_seqs=len(prompts), max_context=settings.max_context,
                                 kv_tokens=settings.kv_tokens, ignore_eos=True)
    requests = [scheduler.add(p, max_new_tokens=new_tokens) for p in prompts]
    start = time.perf_counter()
    read_all = None  # when every prompt had been read (its first token sampled)
    while scheduler.has_work and not _over_limit(settings.time_limit_s, start, read_all):
        scheduler.step()
        if read_all is None and all(r.first_token_s is not None for r in requests):
            read_all = time.perf_counter()
    end = time.perf_counter()
    for request in requests:  # cut short by the time limit: free the pool now
        request.cancel()
    firsts = [r.first_token_s for r in requests if r.first_token_s is not None]
    steps = list(scheduler.history)
    decode_steps = [s for s in steps if s.prefill_tokens == 0]
    generated = sum(len(r.output_ids) for r in requests)
    last_first = max(firsts) if len(firsts) == len(requests) else end
    decoded = generated - len(firsts)
    return {
        "e2e_s": end - start,
        "ttft_s": (min(firsts) if firsts else end) - start,
        "prefill_s": last_first - start,
        "decode_s": end - last_first,
        "generated": generated,
        "complete": generated == new_tokens * len(requests),
        "tok_s": generated / (end - start),
        "decode_tok_s": decoded / (end - last_first) if end > last_first else 0.0,
        "steps": len(steps),
        "step_tokens": dict(collections.Counter(s.tokens for s in steps)),  # {tokens: steps} (the tiers stepped in)
        "sched_ms_per_step": 1e3 * statistics.fmean(s.overhead_s for s in steps),
        "decode_step_ms": 1e3 * statistics.fmean(s.seconds for s in decode_steps) if decode_steps else None,
        "decode_step_ms_median": 1e3 * statistics.median(s.seconds for s in decode_steps) if decode_steps else None,
        # Stalls: the slowest decode step, and how many took over twice the median (a plan made or
        # weights packed beside them, a CUDA graph captured).
        "decode_step_ms_max": 1e3 * max(s.seconds for s in decode_steps) if decode_steps else None,
        "decode_steps_over_2x_median": _over_twice_median([s.seconds for s in decode_steps]),
        "prompt_step_ms_max": 1e3 * max((s.seconds for s in steps if s.prefill_tokens), default=0.0) or None,
        "decode_sched_ms": 1e3 * statistics.fmean(s.overhead_s for s in decode_steps) if decode_steps else None,
        # Of a decode step, the host's time before the forward and in it (the rest: sampling, streaming).
        "decode_prepare_ms": 1e3 * statistics.fmean(s.prepare_s for s in decode_steps) if decode_steps else None,
        "decode_forward_ms_median": 1e3 * statistics.median(s.forward_s for s in decode_steps) if decode_steps else None,
        # Of the forward, the host computing CPU sub-layers / split FFN parts, and blocked on the GPU for them.
        "decode_host_compute_ms_median": _median_ms(s.host_compute_s for s in decode_steps),
        "decode_host_wait_ms_median": _median_ms(s.host_wait_s for s in decode_steps),
        "decode_host_split_ms_median": _median_ms(s.host_split_s for s in decode_steps),  # of the computing
    }


def _over_twice_median(seconds: list[float]) -> int | None:
    return sum(s > 2 * statistics.median(seconds) for s in seconds) if seconds else None


def _median_ms(seconds) -> float | None:
    values = list(seconds)
    return 1e3 * statistics.median(values) if values else None


def _over_limit(limit_s: float | None, start: float, read_all: float | None) -> bool:
    """A run under a time limit decodes for at most ``limit_s`` after its prompts were read, and
    stops reading prompts after three times that (a step in flight always finishes)."""
    if limit_s is None:
        return False
    now = time.perf_counter()
    return now - start > 3 * limit_s or (read_all is not None and now - read_all > limit_s)


STALL_KEYS = ("decode_step_ms_max", "decode_steps_over_2x_median", "prompt_step_ms_max")


def _median_runs(runs: list[dict]) -> dict:
    """The runs' medians; of the stall figures, the slowest step of any run and the slow steps of all."""
    out = dict(runs[0])
    for key, value in out.items():
        if isinstance(value, float) and key not in STALL_KEYS:
            out[key] = statistics.median(r[key] for r in runs)
    for key in STALL_KEYS:
        values = [r[key] for r in runs if r.get(key) is not None]
        out[key] = (sum(values) if key == "decode_steps_over_2x_median" else max(values)) if values else None
    return out


WARMUP_STEPS = 10  # decode steps of each warm-up run: a graph capture, and for a tier's CPU work to be judged
# Warm-up rounds at most: another while the engine has yet to judge a tier the timed runs step in (steps in which
# CPU projections try their paths are no samples: an 8B model's head tried its paths through the first 10-15; a
# tier's first step under a plan is none either) or its one-token decode steps, or when a fit re-planned (the new
# plan's first steps pay its first calls). In the forty-fourth GPU session a warm-up of two rounds left the
# 1024-token prompt's tier (five cells) or the decode steps' dispatch (one) unjudged in each planned cell that
# re-planned: their fits and two switches each came in the timed runs (docs/BENCHMARKS.md).
WARMUP_ROUNDS = 5


def _still_to_judge(engine, timed_steps: dict[int, int]) -> list[str]:
    """What the engine has yet to judge of the plan in force that the timed runs would judge, and re-plan
    on, in their midst: each tier whose CPU work the timed runs' ``timed_steps`` ({step tokens: steps},
    as the warm-up's round stepped) reach the judgment of
    (:meth:`~vramshard.engine.Engine.cpu_steps_to_judge`; a tier stepped too rarely to be judged there,
    such as a batch-1 run's 16-token prompt, will not re-plan them), and its one-token decode steps
    (:meth:`~vramshard.budget_follower.BudgetFollower.decode_steps_to_judge`). Empty: no fit is to come."""
    to_judge = getattr(engine, "cpu_steps_to_judge", None)
    follower = getattr(engine, "budget", None)
    out = []
    if to_judge is not None:
        plans, by_tier = engine.executor.plans, collections.Counter()
        for tokens, steps in timed_steps.items():
            by_tier[plans.tiers[plans.index_for(tokens)]] += steps
        out += [f"tier {tier}'s CPU work" for tier, steps in sorted(by_tier.items()) if 0 < to_judge(tier) <= steps]
    steps = _decode_steps_to_judge(follower)
    if steps:
        out.append(f"{steps} more one-token decode steps")
    return out


def _decode_steps_to_judge(follower) -> int:
    """One-token decode steps the engine's judgment of them still needs (0: none to come)."""
    return follower.decode_steps_to_judge() if hasattr(follower, "decode_steps_to_judge") else 0


def _decode_run(follower) -> int:
    """Decode steps a warm-up run gives that judgment: two more than it needs (a step with CPU path
    trials is no sample), 0 where none is to come."""
    needed = _decode_steps_to_judge(follower)
    return needed + 2 if needed else 0


def _within_context(steps: int, prompt: int, settings: BenchSettings) -> int:
    """``steps`` new tokens, or as many as fit the runs' context after a ``prompt``-token prompt."""
    return max(1, min(steps, settings.max_context - prompt))


def warm_up(engine, settings: BenchSettings) -> None:
    """On a GPU, run the prompt and every batch size before the timed runs, for every engine alike:
    each batch size's first decode steps capture its CUDA graphs, and a planned engine fits its
    profile to the CPU work it measures in each tier's steps and to its one-token decode steps
    (budget_follower), and re-plans. The round is run again (up to WARMUP_ROUNDS) while the engine has
    yet to judge a tier of the timed runs or its decode steps, or when it re-planned, so that the timed
    runs measure the engine as it runs from then on, not its warm-up. A round runs the prompt twice
    while its tier is still to be judged (a tier's first step under a plan is no sample), and decodes
    as many steps as the engine's decode judgment still needs (after a short prompt too, where the
    long one leaves too little of the runs' context for them)."""
    if getattr(engine, "device", "cpu") == "cpu":
        return
    vocab = engine.args.vocab_size
    to_judge = getattr(engine, "cpu_steps_to_judge", None)
    follower = getattr(engine, "budget", None)
    timed: collections.Counter = collections.Counter()  # {step tokens: steps} of the timed runs, as a round steps
    for round_ in range(WARMUP_ROUNDS):
        plan = getattr(engine, "plan", None)
        prompts = 2 if to_judge is not None and to_judge(settings.pp) == 2 else 1  # (its first, then a sample)
        steps = max(WARMUP_STEPS, _decode_run(follower))
        runs = [run_requests(engine, _prompts(1, settings.pp, vocab, 97 + 2 * round_ + i),
                             _within_context(steps, settings.pp, settings), settings) for i in range(prompts)]
        runs = runs[-1:] + [run_requests(engine, _prompts(size, settings.batch_prompt, vocab, 96 - round_),
                                         _within_context(WARMUP_STEPS, settings.batch_prompt, settings), settings)
                            for size in settings.batch_sizes]  # (one run of each shape, as the timed runs have)
        more = _decode_run(follower)
        if more:  # (the long prompt left too little context for them: after a short one)
            run_requests(engine, _prompts(1, settings.batch_prompt, vocab, 95 - round_),
                         _within_context(more, settings.batch_prompt, settings), settings)
        stepped = collections.Counter()
        for run in runs:
            stepped.update(run["step_tokens"])
        timed = timed | collections.Counter({tokens: n * settings.repeat for tokens, n in stepped.items()})
        if plan is None:
            return
        _settle(engine)
        still = _still_to_judge(engine, timed)
        if engine.plan is plan and not still:
            # (When the timed runs begin: a switch logged after this line fell in them.)
            log.info("warm-up done after %d round(s): plan %s in force, %s", round_ + 1, engine.executor.plans.name,
                     "a plan awaited" if engine.budget.refine is not None else "no plan awaited")
            return
        log.info("warm-up round %d: %s; another", round_ + 1,
                 "the engine re-planned" if engine.plan is not plan else "still to judge: " + ", ".join(still))
    log.warning("warm-up ended after %d rounds with %s: a fit may re-plan in the timed runs", WARMUP_ROUNDS,
                ", ".join(_still_to_judge(engine, timed)) or "the engine re-planning")


SETTLE_POLLS = 3  # polls at most after a warm-up round: each may judge a tier and ask for a plan


def _settle(engine) -> None:
    """Put in force the plans the engine's fits asked for: wait for its background planner, poll (a step
    boundary), and again while a plan is still awaited. A poll may itself judge a tier's CPU work and ask for
    a plan: in the forty-third GPU session a fit's two switches (1.0-4.8 s each on an H100 machine) appear to
    have come in the timed runs, the warm-up having ended on the poll that asked for their plan (the log's
    times; docs/BENCHMARKS.md)."""
    for _ in range(SETTLE_POLLS):
        engine.budget.background.wait(60)
        engine.poll_budget()  # the last fit's plan in force
        if engine.budget.refine is None:
            return


def measure(engine, settings: BenchSettings) -> dict:
    """pp/tg/TTFT/e2e of one request and batched throughput of each batch size (after a warm-up)."""
    vocab = engine.args.vocab_size
    warm = min(settings.pp, 64)
    run_requests(engine, _prompts(1, warm, vocab, 99), 2, settings)
    run_requests(engine, _prompts(min(4, max(settings.batch_sizes)), min(settings.batch_prompt, 16), vocab, 98), 2,
                 settings)
    warm_up(engine, settings)
    runs = [run_requests(engine, _prompts(1, settings.pp, vocab, settings.seed + r), settings.tg, settings)
            for r in range(settings.repeat)]
    single = _median_runs(runs)
    result = {
        "pp_tok_s": settings.pp / single["ttft_s"],
        # tg: the steady decode rate of one sequence, from the median decode step. A step that
        # first meets a CUDA-graph bucket captures it (70-170 ms once on the H200); at pp=1024 that
        # is the first decode step, inside the tg window. tg_with_warmup_tok_s keeps every step.
        "tg_tok_s": 1e3 / single["decode_step_ms_median"] if settings.tg > 1 and single["decode_step_ms_median"]
        else None,
        "tg_with_warmup_tok_s": single["decode_tok_s"] if settings.tg > 1 and single["decode_s"] else None,
        "ttft_s": single["ttft_s"],
        "ttft_runs_s": [run["ttft_s"] for run in runs],  # each run's, in order (ttft_s is their median)
        "e2e_s": single["e2e_s"],
        "sched_ms_per_step": single["sched_ms_per_step"],
        "decode_step_ms": single["decode_step_ms"],
        "decode_step_ms_median": single["decode_step_ms_median"],
        "decode_sched_ms": single["decode_sched_ms"],
        "decode_prepare_ms": single["decode_prepare_ms"],
        "decode_forward_ms_median": single["decode_forward_ms_median"],
        "decode_host_compute_ms_median": single["decode_host_compute_ms_median"],
        "decode_host_split_ms_median": single["decode_host_split_ms_median"],
        "decode_host_wait_ms_median": single["decode_host_wait_ms_median"],
        **{key: single[key] for key in STALL_KEYS},
        "complete": single["complete"],
        "batched": {},
    }
    for size in settings.batch_sizes:
        runs = [run_requests(engine, _prompts(size, settings.batch_prompt, vocab, settings.seed + 1000 * size + r),
                             settings.batch_gen, settings) for r in range(settings.repeat)]
        result["batched"][str(size)] = _median_runs(runs)
    return result


def bench_engine(model, host, spec: EngineSpec, settings: BenchSettings, device: str | None = None,
                 profile=None) -> dict:
    """Build the engine of ``spec`` over the shared ``host`` weights, measure it, let it go.

    ``host``: packed weights, or a :class:`~vramshard.runtime.host_weights.HostLayouts`, which
    gives the planned engine (it may split FFNs between the CPU and the GPU) the split layout and
    every named placement the checkpoint's layout. Failures to build (a placement that does not
    fit, no GPU) come back as ``{"error": ...}``."""
    import torch

    from ..engine import Engine
    from ..runtime.host_weights import HostLayouts

    loading = Timeline()
    if isinstance(host, HostLayouts):
        gpu = device != "cpu" and torch.cuda.is_available()
        with loading.phase("split layout"):  # (made on the first planned engine's need, then shared)
            host = host.split if spec.placement is None and gpu else host.plain

    row = {"engine": spec.label, "placement_asked": spec.placement, "vram": spec.vram}
    try:
        engine = Engine.from_host(model, host, vram=spec.vram, device=device, placement=spec.placement,
                                  max_context=settings.max_context, kv_tokens=settings.kv_tokens, profile=profile,
                                  timeline=loading, **spec.options)
    except VramshardError as exc:
        log.warning("%s: %s", spec.label, exc)
        return {**row, "error": str(exc)}
    try:
        executor = engine.executor
        row.update(placement=executor.plans.name, budget=engine.vram_budget, uses_gpu=executor.uses_gpu,
                   resident_bytes=executor.need.resident, vram_plan_bytes=executor.need.total,
                   # (the weights those bytes hold: more where pins are kept coded)
                   resident_weight_bytes=executor.resident_weight_bytes,
                   vram_plan={**dataclasses.asdict(executor.need), "total": executor.need.total},
                   kv_layers_in_vram=len(executor.kv_layers_on_gpu),
                   planned=engine.plan is not None, load_seconds=engine.load_seconds,
                   load_s=sum(engine.load_seconds.values()))
        row.update(measure(engine, settings))
        row["decode_vs_plan"] = engine.plan_check().summary()  # single-sequence decode steps vs prediction
        row["calibrations"] = list(engine.budget.calibrations)  # the profile fitted to the steps, re-planned
        row["placement_at_end"] = executor.plans.name
        # (A re-plan may move KV caches. Session 46's A/B of the KV split could tell whether the planner split
        # the cache only from the log's VRAM plan line.)
        row["kv_layers_in_vram_at_end"] = len(executor.kv_layers_on_gpu)
        row["peak_vram_bytes"] = executor.peak_vram()
        row["within_budget"] = engine.vram_budget is None or row["peak_vram_bytes"] <= engine.vram_budget
    finally:
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return row


def run_bench(model, host, specs: list[EngineSpec], settings: BenchSettings, device: str | None = None,
              profile=None, on_result: Callable[[dict], None] | None = None) -> list[dict]:
    """:func:`bench_engine` for every spec, in order; ``on_result`` sees each row as it is made."""
    rows = []
    for spec in specs:
        row = bench_engine(model, host, spec, settings, device, profile)
        rows.append(row)
        if on_result is not None:
            on_result(row)
    return rows


def baseline_specs(text: str | None, vram) -> list[EngineSpec]:
    """``"layers:max,cpu"`` → baseline engine specs at the same budget."""
    names = [part.strip() for part in (text or "").split(",") if part.strip()]
    return [EngineSpec(name, placement=name, vram=vram) for name in names]


# ---------------------------------------------------------------------------- the model
def load_host(model_path: str | None, shape: str | None, dtype: str | None, layers: int | None, pin: bool,
              seed: int = 0):
    """(model, :class:`HostLayouts` of the packed host weights, name): a checkpoint, or a named
    shape with random weights."""
    from ..runtime.host_weights import HostLayouts, pack_model

    model, weights, name = load_weights_of(model_path, shape, dtype, layers, seed)
    return model, HostLayouts(list(model), pack_model(list(model), weights, pin=pin, splittable=False), pin), name


def load_weights_of(model_path: str | None, shape: str | None, dtype: str | None, layers: int | None = None,
                    seed: int = 0):
    """(model, CPU weights, name): a checkpoint, or a named shape with random weights."""
    from ..config import parse_dtype
    from ..models import build_model

    if (model_path is None) == (shape is None):
        raise InvalidInputError("give either MODEL (a model directory or .gguf file) or --shape NAME, not both")
    if shape is not None:
        from ..shapes import random_weights, shape_config

        config = shape_config(shape)
        if layers:
            config["num_hidden_layers"] = layers
        model = build_model(config, parse_dtype(dtype))
        return model, random_weights(model, seed), (shape if not layers else f"{shape} ({layers} layers)")
    from ..loading.checkpoint import open_checkpoint
    from ..runtime.weights import load_weights

    if layers:
        raise InvalidInputError("--layers cuts a --shape model; it does not apply to a checkpoint")
    checkpoint = open_checkpoint(model_path)
    model = build_model(checkpoint.config, parse_dtype(dtype))
    return model, load_weights(model, checkpoint), checkpoint.path.name


def weights_bytes(model) -> int:
    return model.nbytes


# ---------------------------------------------------------------------------- output
def results_table(rows: list[dict], settings: BenchSettings, title: str = "vramshard bench"):
    """A rich table: one row per engine."""
    from rich.table import Table

    table = Table(title=title)
    for name in ("engine", "placement", f"pp{settings.pp} tok/s", f"tg{settings.tg} tok/s", "TTFT ms", "e2e s"):
        table.add_column(name, justify="left" if name in ("engine", "placement") else "right")
    for size in settings.batch_sizes:
        table.add_column(f"b{size} tok/s", justify="right")
    table.add_column("sched ms/step", justify="right")
    table.add_column("load s", justify="right")
    table.add_column("peak VRAM", justify="right")
    for row in rows:
        if "error" in row:
            table.add_row(row["engine"], f"[red]{row['error'][:70]}[/red]")
            continue
        batched = [_num(row["batched"][str(s)]["tok_s"]) for s in settings.batch_sizes]
        table.add_row(row["engine"], _short(row["placement"]), _num(row["pp_tok_s"]), _num(row["tg_tok_s"]),
                      _num(row["ttft_s"] * 1e3), _num(row["e2e_s"]), *batched, _num(row["sched_ms_per_step"], 2),
                      _num(row.get("load_s")), format_bytes(row["peak_vram_bytes"]) if row["uses_gpu"] else "-")
    return table


def _num(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _short(text: str, width: int = 40) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def write_png(rows: list[dict], settings: BenchSettings, path: str | Path, title: str = "vramshard bench") -> None:
    """Bar charts (one panel per metric, one bar per engine) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    good = [r for r in rows if "error" not in r]
    metrics = [(f"pp{settings.pp} tok/s", lambda r: r["pp_tok_s"]),
               (f"tg{settings.tg} tok/s", lambda r: r["tg_tok_s"] or 0.0),
               ("TTFT ms", lambda r: r["ttft_s"] * 1e3)]
    metrics += [(f"batch {s} tok/s", lambda r, s=s: r["batched"][str(s)]["tok_s"]) for s in settings.batch_sizes]
    fig, axes = plt.subplots(1, len(metrics), figsize=(2.6 * len(metrics), 3.4), squeeze=False)
    labels = [r["engine"] for r in good]
    colors = [f"C{i}" for i in range(len(good))]
    for ax, (name, value) in zip(axes[0], metrics):
        ax.bar(range(len(good)), [value(r) for r in good], color=colors)
        ax.set_title(name, fontsize=9)
        ax.set_xticks(range(len(good)), labels, rotation=45, ha="right", fontsize=8)
        ax.tick_params(axis="y", labelsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(rows: list[dict], settings: BenchSettings, info: dict) -> dict:
    """The JSON document of a bench run."""
    return {**info, "settings": asdict(settings), "results": rows}


# ---------------------------------------------------------------------------- the command
def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers such as 1,4,16,64, got {text!r}")
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be >= 1, got {text!r}")
    return sizes


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench", help="measure prompt, generation and batched speed against placement baselines",
        description="llama-bench-style speed test of the planned engine and of --baselines placements, "
                    "in one run. With --shape, a random-weight model of a real shape is built in memory.",
    )
    parser.add_argument("model", metavar="MODEL", nargs="?", default=None,
                        help="Hugging Face model directory or .gguf file (or use --shape)")
    parser.add_argument("--shape", metavar="NAME", help="random weights of a named shape, e.g. nemo-8b, llama3-8b, "
                                                        "qwen3-30b-a3b, tiny-llama (no download)")
    parser.add_argument("--layers", type=int, default=None, metavar="N", help="cut a --shape model to N layers")
    parser.add_argument("--vram", default=None, metavar="SIZE",
                        help="VRAM budget, e.g. 4GiB or 2048MiB, or auto (free VRAM minus a safety margin)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="where to run (default: cuda when available)")
    parser.add_argument("--dtype", default=None, choices=("float32", "float16", "bfloat16"),
                        help="weights and compute dtype (default: the checkpoint's or shape's)")
    parser.add_argument("--placement", default=None, metavar="NAME",
                        help="run the candidate with this placement instead of the planned one")
    parser.add_argument("--baselines", default=None, metavar="LIST",
                        help="placements to compare in the same run, e.g. layers:max,cpu "
                             "(default: layers:max,cpu with a GPU, none without)")
    parser.add_argument("--profile", metavar="PATH", default=None, help="machine profile for the planner")
    add_threads_arg(parser)
    parser.add_argument("-p", "--pp", type=int, default=512, metavar="N", help="prompt tokens (default 512)")
    parser.add_argument("-n", "--tg", type=int, default=128, metavar="N", help="generated tokens (default 128)")
    parser.add_argument("-b", "--batch-sizes", type=_sizes, default=DEFAULT_BATCHES, metavar="LIST",
                        help="batch sizes for throughput (default 1,4,16,64)")
    parser.add_argument("--batch-prompt", type=int, default=32, metavar="N",
                        help="prompt tokens of each batched sequence (default 32)")
    parser.add_argument("--batch-gen", type=int, default=32, metavar="N",
                        help="new tokens of each batched sequence (default 32)")
    parser.add_argument("-r", "--repeat", type=int, default=1, metavar="N", help="runs per test; the median is kept")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts")
    parser.add_argument("--compile", action="store_true",
                        help="also run the planned engine with its CUDA-graph decode steps' element-wise work "
                             "fused by torch.compile (row vramshard+compiled)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON here")
    parser.add_argument("--png", metavar="PATH", help="draw the results as a bar chart (PNG) here")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ..engine import resolve_budget
    from ..plan.planner import machine_profile

    console = Console(stderr=True, highlight=False)
    settings = BenchSettings(args.pp, args.tg, tuple(args.batch_sizes), args.batch_prompt, args.batch_gen,
                             args.repeat, args.seed)
    budget, device = resolve_budget(args.vram, args.device)
    vram = budget  # "auto" is measured once, so every engine gets the same budget
    baselines = args.baselines
    if baselines is None:
        baselines = "layers:max,cpu" if device != "cpu" else ""
    label = "vramshard" if args.placement is None else args.placement
    threads = {"threads": args.threads} if args.threads else {}  # (every engine alike)
    specs = [EngineSpec(label, args.placement, vram, dict(threads))]
    if args.compile and device != "cpu":
        specs.append(EngineSpec(f"{label}+compiled", args.placement, vram, {"decode_compile": "inductor", **threads}))
    specs += [replace(spec, options={**spec.options, **threads}) for spec in baseline_specs(baselines, vram)]
    profile = machine_profile(args.profile) if args.profile else None
    started = time.perf_counter()
    with console.status("building the model"):
        model, host, name = load_host(args.model, args.shape, args.dtype, args.layers,
                                      pin=device != "cpu", seed=args.seed)
    console.print(f"[dim]{name}: {format_bytes(weights_bytes(model))} of weights, built in "
                  f"{time.perf_counter() - started:.1f} s; device {device}, budget "
                  f"{format_bytes(budget) if budget is not None else 'none'}[/dim]")

    def show(row):
        state = row.get("error") or f"{row['placement']}: tg {_num(row['tg_tok_s'])} tok/s"
        console.print(f"[dim]{row['engine']}: {state}[/dim]", soft_wrap=True)

    rows = run_bench(model, host, specs, settings, device=device, profile=profile, on_result=show)
    title = f"vramshard bench · {name} · {device} · budget {format_bytes(budget) if budget is not None else 'none'}"
    Console(highlight=False).print(results_table(rows, settings, title))
    info = {"model": name, "device": device, "budget": budget, "weights_bytes": weights_bytes(model),
            "dtype": str(model.dtype).replace("torch.", ""), "elapsed_s": time.perf_counter() - started}
    if args.json:
        write_json(args.json, report(rows, settings, info))
        console.print(f"[dim]wrote {args.json}[/dim]")
    if args.png:
        write_png(rows, settings, args.png, title)
        console.print(f"[dim]wrote {args.png}[/dim]")
    return 0 if any("error" not in row for row in rows) else 1


def write_json(path: str | Path, data) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str))
