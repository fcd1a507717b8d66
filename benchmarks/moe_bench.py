"""MoE benchmark on the GPU machine: Qwen3-30B-A3B (bf16, random weights) at 2, 8, 16 GiB.

    PYTHONPATH=src python -m benchmarks.moe_bench            # JSON to $OUT/moe_bench.json

Weights are made on the GPU one tensor piece at a time and copied straight into each
sub-layer's pinned packed host buffer (no second host copy: ~57 GiB of 128 GiB RAM).
For each budget and placement — the planner's, ``experts-stream`` (cache filling the
budget), and the baselines ``layers:max`` and ``experts-cpu`` — decode tok/s at a 1K
context, TTFT of a 1K prompt, and batched decode tok/s at batch 1/4/16/64 (64-token
contexts, a separate KV reservation); peak VRAM; expert-cache hit rate; the estimator's decode
tok/s for the cell's one-token plan (``predicted_decode_tok_s``). The bound of a
decode step comes from routed-expert bytes: per token each MoE layer needs top-k experts,
and those not in VRAM (uniform routing: the cache holds a slots/(layers x experts)
fraction) must come over PCIe or be read by the CPU:
``bound tok/s = bw / (missed routed-expert bytes + other non-resident bytes)``, with ``bw`` the
smaller of PCIe + CPU read bandwidth (each alone) and what host memory gives both at once;
for ``experts-stream`` alone the PCIe part counts (``pcie_bound_tok_s``), for ``experts-cpu`` the host's read
alone (``host_read_bound_tok_s``, and ``decode_fraction_of_host_read_bound``). Random routers
route almost uniformly; a last run biases the routers (a Zipf-like prior on a constant
embedding channel) to show the cache at work.
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import time

import torch

from vramshard.errors import BudgetError
from vramshard.layers import cpu_compiled, host_experts
from vramshard.layers.moe import MoEFFN
from vramshard.layers.step import Step
from vramshard.plan.estimator import Estimator, balanced_zero_copy_share, expert_cpu_share, uniform_hit_rate
from vramshard.plan.memory import expert_slot_bytes, max_resident_layers, moe_layers, sublayer_triples, vram_need
from vramshard.plan.placement import named_placement
from vramshard.plan.planner import Planner, machine_profile
from vramshard.plan.tiers import Tiers
from vramshard.runtime import wire_codec, zero_copy_experts
from vramshard.runtime.executor import Executor
from vramshard.runtime.host_weights import PackedLayout, PackedWeights, _empty_host
from vramshard.shapes import shape_model

from .common import (cpu_read_bandwidth, h2d_bandwidth, hardware, now, out_dir, scaled_to_this_host,
                     shared_read_bandwidth, sync, timed, write_json)

log = logging.getLogger("moe_bench")
GiB = 2**30
CHUNK = 2**26  # elements generated on the GPU at a time


def random_packed(model, seed: int = 0) -> dict[str, PackedWeights]:
    """Pinned packed host buffers of random weights (std 0.02, norms 1), built piece by piece on the GPU."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    host = {}
    for sublayer in model:
        layout = PackedLayout.of(sublayer)
        buffer = _empty_host(layout.nbytes, pin=True)
        views = layout.views(buffer)
        for spec in sublayer.weights:
            target = views[spec.key].view(-1)
            if len(spec.shape) == 1:
                target.fill_(1.0)
                continue
            for begin in range(0, target.numel(), CHUNK):
                end = min(begin + CHUNK, target.numel())
                part = torch.randn(end - begin, generator=generator, device="cuda") * 0.02
                target[begin:end].copy_(part.to(spec.dtype))
        host[sublayer.name] = PackedWeights(layout, buffer, views)
    torch.cuda.synchronize()
    return host


def skew_routing(model, host, alpha: float = 2.0, channel_value: float = 3.0) -> None:
    """Bias every router towards a Zipf-like ranking of experts (different per layer): embedding
    channel 0 becomes a constant, so after the norm it dominates, and router column 0 carries
    -alpha * log(rank + 1) per expert."""
    embed = host["embed"].views
    table = next(v for k, v in embed.items() if v.dim() == 2)
    table[:, 0] = channel_value
    d = model.args.hidden_size
    rms = math.sqrt((channel_value**2 + (d - 1) * 0.02**2) / d)
    h0 = channel_value / rms  # channel 0 after the norm (norm weights are 1)
    for sublayer in model:
        if isinstance(sublayer, MoEFFN):
            ranks = torch.randperm(sublayer.num_experts, generator=torch.Generator().manual_seed(sublayer.layer))
            bias = -alpha * torch.log(ranks.float() + 1)
            host[sublayer.name].views["router"][:, 0] = (bias / h0).to(host[sublayer.name].views["router"].dtype)


def fill_kv(kv, context: int) -> None:
    for layer in kv._layers.values():
        layer.k[:, :context].normal_()
        layer.v[:, :context].normal_()


def decode_tok_s(executor: Executor, context: int, steps: int) -> float:
    kv = executor.new_kv_cache(1, context + steps + 4)
    fill_kv(kv, context)
    state = {"pos": context}

    def one():
        executor.forward(torch.tensor([11]), Step.single(state["pos"], 1, kv_lookup=kv))
        state["pos"] += 1

    return 1 / timed(one, repeat=steps, warmup=2, budget_s=30)


def ttft_s(executor: Executor, prompt: int) -> float:
    kv = executor.new_kv_cache(1, prompt + 1)
    ids = torch.randint(0, 1000, (prompt,))
    return timed(lambda: executor.forward(ids, Step.single(0, prompt, kv_lookup=kv)), repeat=1, warmup=1, budget_s=60)


def batched_tok_s(executor: Executor, batch: int, context: int, steps: int) -> float:
    kv = executor.new_kv_cache(batch, context + steps + 4)
    fill_kv(kv, context)
    state = {"pos": context}

    def one():
        step = Step(list(range(batch)), [state["pos"]] * batch, [1] * batch, list(range(batch)), kv_lookup=kv)
        executor.forward(torch.full((batch,), 11), step)
        state["pos"] += 1

    return batch / timed(one, repeat=steps, warmup=1, budget_s=30)


def cpu_kernel_state() -> dict:
    """Whether the CPU's compiled expert kernels run here, and for which dtypes (and thread counts, where a
    kernel is compiled per count: :func:`~vramshard.layers.cpu_compiled.kernels_read_threads_at_run_time`)."""
    return {"release_gil": cpu_compiled.kernels_release_gil(),
            **{name: {"compiled": sorted("/".join(map(str, key)) for key in kernel._compiled),  # (dtype[, threads])
                      "failed": kernel.failed}
               for name, kernel in (("one_token", host_experts._one_token_kernel), ("rows", host_experts._kernel))}}


HELD_WARNING = 256 * 2**20  # VRAM still held when an executor is made: something kept the last one's alive


def make_executor(model, host, placement, budget, args, kv_slots=1, max_context=None, expert_cache=None,
                  options=None):
    gc.collect()
    torch.cuda.empty_cache()
    held = torch.cuda.memory_reserved()
    if held > HELD_WARNING:  # (counted in this phase's peak: the cell would read as over its budget)
        log.warning("%.2f GiB of VRAM still held before this executor: a reference kept an earlier one's buffers",
                    held / GiB)
    return Executor(model, host, placement, budget=budget, max_tokens=args.prompt,
                    max_context=max_context or args.ctx + args.prompt + 16, kv_slots=kv_slots,
                    threads=args.threads, expert_cache=expert_cache,
                    decode_graphs=getattr(args, "decode_graphs", True), **(options or {}))


def bench_profile(path: str | None, dtype) -> tuple[object, str]:
    """(profile, where it came from): ``path``'s, or this machine's stored one, its CPU side scaled to
    the host's memory read now as an engine scales it when it loads (:mod:`vramshard.profile.drift`),
    so that the planned cell is the plan an engine would make here and each cell's prediction prices
    this host (before session 41 the profile's machine: on a host reading at half its rate the
    predictions stayed at 40.3-40.4 tok/s)."""
    return scaled_to_this_host(machine_profile(path), path or "stored", dtype)


def placements_for(model, budget, args, profile):
    """(label, placement, expert cache bytes, executor options) of every candidate at this budget.

    ``experts-hybrid`` is ``experts-stream`` whose decode steps compute a share of the cache misses
    on the CPU meanwhile (the share from the profile: :func:`~vramshard.plan.estimator.expert_cpu_share`);
    ``experts-prefetch`` is ``experts-stream`` whose decode steps guess the next layer's experts and
    start copying them early (``Executor(expert_prefetch=True)``); ``experts-zero-copy`` is
    ``experts-cpu`` whose decode steps have the GPU read the experts from pinned host memory
    (``Executor(experts_zero_copy=True)``), and ``experts-stream-zero-copy`` the same for
    ``experts-stream``'s misses (its hits from their cache slots), where Triton and a GPU are there;
    ``experts-zero-copy-cpu`` has the CPU compute a share of ``experts-zero-copy``'s experts meanwhile
    (:func:`~vramshard.plan.estimator.balanced_zero_copy_share`), ``experts-zero-copy-cpu@S`` at the
    share S of ``--shares``. ``planned`` carries the planner's own share in its decode tiers (with
    the run-ahead worker on)."""
    triples, layers, moe = sublayer_triples(model), model.args.num_hidden_layers, moe_layers(model)
    kv_tokens = args.ctx + args.prompt + 16
    out = []
    tiers = Tiers((1, 4, 16, 64, 256, 1024))
    try:
        plan = Planner(model, profile, budget, context=kv_tokens, tiers=tiers).plan()
        out.append(("planned", plan.tiered(), plan.expert_cache or None, {}))
    except BudgetError as exc:
        out.append(("planned", exc, None, {}))
    stream = named_placement("experts-stream", triples, layers, moe_layers=moe)
    slot = expert_slot_bytes(model)
    rest = vram_need(model, stream, 1, kv_tokens, args.prompt, expert_cache=0).total
    cache = (budget - rest) // slot * slot
    stream_or_error = stream if cache >= 2 * slot else BudgetError(
        f"experts-stream needs {rest / GiB:.2f} GiB before its cache")
    out.append(("experts-stream", stream_or_error, cache, {"experts_zero_copy": False}))  # misses copied in
    if zero_copy_experts.supported():  # hits from their slots, misses read from pinned host memory
        out.append(("experts-stream-zero-copy", stream_or_error, cache, {"experts_zero_copy": True}))
    out.append(("experts-hybrid", stream_or_error, cache, {"expert_cpu_share": expert_cpu_share(model, profile)}))
    out.append(("experts-prefetch", stream_or_error, cache, {"expert_prefetch": True}))
    most = max_resident_layers(model, budget, 1, kv_tokens, args.prompt)
    out.append(("layers:max", named_placement("layers:max", triples, layers, most), None, {}))
    experts_cpu = named_placement("experts-cpu", triples, layers, moe_layers=moe)
    out.append(("experts-cpu", experts_cpu, None, {"experts_zero_copy": False}))  # the baseline: computed by the CPU
    if zero_copy_experts.supported():  # the same experts read by the GPU from pinned host memory
        out.append(("experts-zero-copy", experts_cpu, None, {"experts_zero_copy": True}))
        # ... and a share of them computed by the CPU meanwhile, balanced by the profile
        out.append(("experts-zero-copy-cpu", experts_cpu, None,
                    {"experts_zero_copy": True, "zero_copy_cpu_share": balanced_zero_copy_share(model, profile)}))
        for share in getattr(args, "shares", None) or ():  # ... and at the shares asked for (--shares)
            out.append((f"experts-zero-copy-cpu@{share:g}", experts_cpu, None,
                        {"experts_zero_copy": True, "zero_copy_cpu_share": share}))
    return out


def in_order(cells: list, placements: str | None) -> list:
    """``cells`` (placements_for's) named in ``placements`` (comma-separated labels), in that order, then
    the ``--shares`` cells not named there; all of them, as they come, when ``placements`` is None."""
    if not placements:
        return cells
    names = placements.split(",")
    by_label = {cell[0]: cell for cell in cells}
    for name in names:
        if name not in by_label:
            log.warning("--placements names %r, which is no cell here (cells: %s)", name, ", ".join(by_label))
    return [by_label[name] for name in names if name in by_label] + \
        [cell for cell in cells if "@" in cell[0] and cell[0] not in names]


def routed_bound(model, executor, bw) -> dict:
    """Decode bound from routed-expert bytes not in VRAM (uniform routing) plus other non-resident bytes
    (MoE layers' main pieces included where they are neither resident nor split)."""
    moe = [s for s in model if isinstance(s, MoEFFN)]
    slot = expert_slot_bytes(model)
    routed = sum(s.top_k * slot for s in moe)
    resident_moe = [s for s in moe if s.name in executor.resident]
    routed -= sum(s.top_k * slot for s in resident_moe)
    cached_fraction = 0.0
    if executor.expert_cache is not None:
        cached_fraction = min(1.0, executor.expert_cache.capacity / (len(moe) * moe[0].num_experts))
    missed = routed * (1 - cached_fraction)
    non_expert = sum(s.nbytes for s in model if not isinstance(s, MoEFFN) and s.name not in executor.resident
                     and s.kind != "embed")
    # The main pieces (norm, router, a shared expert) of MoE layers neither resident nor split at their
    # experts (a split layer keeps its main piece in VRAM).
    non_expert += sum(s.main_bytes for s in moe if s.name not in executor.resident
                      and s.name not in executor.split_weights)
    # Coded stream fills (VRAMSHARD_WIRE_CODEC) carry the streamed non-expert weights in RATIO of their bytes; the
    # routed experts' reads (cache fills, the GPU's zero-copy kernels, the CPU) are raw.
    total = missed + non_expert * (wire_codec.RATIO if executor.wire_codec else 1.0)
    bandwidth = min(bw["h2d"] + bw["cpu_read"], bw["shared_total"])  # the memory bus may be the limit
    return {"routed_bytes_per_token": routed, "missed_routed_bytes": missed, "other_nonresident_bytes": non_expert,
            "bound_tok_s": bandwidth / total if total else None,
            "additive_bound_tok_s": (bw["h2d"] + bw["cpu_read"]) / total if total else None,
            "pcie_bound_tok_s": bw["h2d"] / total if total else None,
            "host_read_bound_tok_s": bw["cpu_read"] / total if total else None}


def predicted_decode_tok_s(model, profile, executor, options: dict, ctx: int) -> float:
    """The estimator's decode tok/s for the executor's one-token plan, with the executor's
    zero-copy switch and CPU share (its own, or its plan's) and the cache's uniform-routing hit rate (it does not model
    ``expert_prefetch`` or ``expert_cpu_share``)."""
    placement, threads = executor.plans.for_tokens(1)
    slots = executor.expert_cache.capacity if executor.expert_cache is not None else 0
    estimator = Estimator(model, profile, threads=threads, expert_hit_rate=uniform_hit_rate(model, slots),
                          zero_copy=executor.experts_zero_copy and zero_copy_experts.supported(),
                          zero_copy_cpu_share=executor.zero_copy_share(1))
    return 1.0 / estimator.simulate(placement, 1, ctx).seconds


def decode_phase(executor, cell: dict, args, bw, deadline) -> None:
    """Decode tok/s, the last decode step's account and TTFT of ``executor`` into ``cell``.

    A function of its own so that nothing it reads from the executor (its graphs, its report) outlives
    it: the caller drops the executor next, and a name still held here kept the decode graphs, and the
    resident weights they replay over, alive into the next phase (2.4-2.9 GiB of qwen3-30b-a3b's over
    its 8 GiB budget in sessions 45-46)."""
    cell["decode_tok_s"] = decode_tok_s(executor, args.ctx, args.decode_steps)
    # The resident attention layers' decode graphs (--decode-graphs; an Engine's default): replays, captures and
    # the steps left eager, by reason.
    graphs = executor.graphs
    cell["decode_graphs"] = None if graphs is None else {"replays": graphs.stats.replays, "captures": graphs.stats.captures,
                                                         "eager": dict(graphs.stats.fallbacks)}
    report = executor.report
    # The last decode step's own account: with run-ahead, "compute" is the worker's computing and
    # "wait" its waiting for the GPU to say a part's input landed (the twenty-fourth GPU session's share
    # cells decoded 4-5x slower than the twenty-third's; a one-thread kernel is the likely cause: these
    # tell which side was slow).
    cell["decode_step_ms"] = report.seconds * 1e3
    cell["decode_host_compute_ms"] = report.host_compute_s * 1e3
    cell["decode_host_wait_ms"] = report.host_wait_s * 1e3
    # The worker's parts (session 27: ~1 ms a layer whatever the share): their longest, and how much of
    # their computing was the expert pass's compiled call, the rest being glue and copies.
    parts = report.extra.get("worker_parts")
    if parts:
        cell["decode_worker_parts"] = parts["parts"]
        cell["decode_worker_longest_part_ms"] = parts["longest_s"] * 1e3
        cell["decode_worker_expert_kernel_ms"] = parts["expert_kernel_s"] * 1e3
        cell["decode_worker_team"] = parts.get("team")
        cell["decode_worker_idle_ms"] = parts.get("idle_s", 0.0) * 1e3  # between parts: the host thread's next one, the GIL
        cell["decode_host_buffer_wait_ms"] = parts.get("host_buffer_wait_s", 0.0) * 1e3  # host two parts ahead
    cell["cpu_kernels"] = cpu_kernel_state()
    cell["decode_bytes_streamed"] = report.bytes_streamed
    cell["decode_expert_hit_rate"] = report.expert_hit_rate
    if cell["bound_tok_s"]:
        cell["decode_fraction_of_bound"] = cell["decode_tok_s"] / cell["bound_tok_s"]
    if cell.get("host_read_bound_tok_s"):  # (the CPU's path alone: what experts-cpu can reach at most)
        cell["decode_fraction_of_host_read_bound"] = cell["decode_tok_s"] / cell["host_read_bound_tok_s"]
    if executor.expert_cache is not None and report.bytes_streamed:  # a step that streamed nothing has no such bound
        cell["pcie_measured_bound_tok_s"] = bw["h2d"] / report.bytes_streamed
        stats = executor.expert_cache.stats  # since the executor was made (warm-up included)
        cell["misses_computed_on_cpu"] = stats.elsewhere / max(stats.misses, 1)
        if stats.prefetched:  # of the experts copied ahead on a guess, the share a step then used
            cell["prefetched_used"] = stats.prefetch_used / stats.prefetched
    if time.perf_counter() < deadline:
        cell["ttft_s"] = ttft_s(executor, args.prompt)


def run_cell(model, host, label, placement, cache, budget, args, bw, deadline, options=None, profile=None) -> dict:
    cell = {"placement": label, "budget_gib": budget / GiB, **(options or {})}
    if isinstance(placement, Exception):
        cell["error"] = str(placement)
        return cell
    if time.perf_counter() > deadline:
        cell["error"] = "skipped: benchmark time limit"
        return cell
    torch.cuda.reset_peak_memory_stats()
    try:
        executor = make_executor(model, host, placement, budget, args, expert_cache=cache, options=options)
    except BudgetError as exc:
        cell["error"] = str(exc)
        return cell
    cell["name"] = executor.plans.name
    cell["zero_copy_cpu_share"] = executor.zero_copy_share(1)  # (the option's, or the plan's decode tier's)
    cell["vram_plan_gib"] = executor.need.total / GiB
    cell["expert_cache_gib"] = executor.expert_cache_bytes / GiB
    cell.update(routed_bound(model, executor, bw))
    if profile is not None:
        cell["predicted_decode_tok_s"] = predicted_decode_tok_s(model, profile, executor, options or {}, args.ctx)
    decode_phase(executor, cell, args, bw, deadline)
    cell["peak_vram_gib"] = torch.cuda.max_memory_reserved() / GiB
    # Each executor resets the peak when it starts: one peak per phase, against that executor's plan.
    phases = {"decode+ttft": {"peak_gib": cell["peak_vram_gib"], "plan_gib": executor.need.total / GiB,
                              "before_gib": executor._vram_before / GiB,
                              "allocated_peak_gib": torch.cuda.max_memory_allocated() / GiB}}
    del executor
    batched = {}
    for batch in (int(b) for b in args.batches.split(",") if b):
        if time.perf_counter() > deadline:
            break
        try:
            executor = make_executor(model, host, placement, budget, args, kv_slots=batch,
                                     max_context=args.batch_ctx + 8, expert_cache=cache, options=options)
            batched[batch] = batched_tok_s(executor, batch, args.batch_ctx, args.batch_steps)
            phases[f"batch {batch}"] = {"peak_gib": torch.cuda.max_memory_reserved() / GiB,
                                        "plan_gib": executor.need.total / GiB,
                                        "before_gib": executor._vram_before / GiB,
                                        "allocated_peak_gib": torch.cuda.max_memory_allocated() / GiB}
            cell["peak_vram_gib"] = max(cell["peak_vram_gib"], phases[f"batch {batch}"]["peak_gib"])
            del executor
        except BudgetError as exc:
            batched[batch] = f"error: {exc}"
    cell["batched_tok_s"] = batched
    cell["peak_by_phase"] = phases
    cell["within_budget"] = cell["peak_vram_gib"] * GiB <= budget
    return cell


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--budgets", default="2,8,16", help="GiB, comma-separated")
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--batch-ctx", type=int, default=64)
    parser.add_argument("--batch-steps", type=int, default=3)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--time-limit", type=float, default=480.0, help="seconds; later cells are skipped")
    parser.add_argument("--placements", default=None,
                        help="comma-separated labels to run, in this order (planned, experts-stream, "
                             "experts-stream-zero-copy, experts-hybrid, experts-prefetch, layers:max, experts-cpu, "
                             "experts-zero-copy, experts-zero-copy-cpu, experts-zero-copy-cpu@S of --shares); default all")
    parser.add_argument("--shares", type=lambda text: [float(s) for s in text.split(",") if s], default=[],
                        help="comma-separated CPU shares of experts-zero-copy's experts, each a cell "
                             "experts-zero-copy-cpu@S, whatever --placements names")
    parser.add_argument("--no-skewed", action="store_true", help="skip the skewed-routing cell at the end")
    parser.add_argument("--decode-graphs", action=argparse.BooleanOptionalAction, default=True,
                        help="decode steps replay CUDA graphs over the resident sub-layers, as an Engine's do "
                             "(default since session 45; every run until then timed eager attention: "
                             "--no-decode-graphs)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--profile", default=None,
                        help="profile JSON of this machine (`vramshard profile`); default: the stored one. The "
                             "planner needs measured CPU expert speeds: a synthetic roofline profile makes the CPU "
                             "look 2-4x faster than it is at few-token MoE steps")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    t_start = time.perf_counter()
    deadline = t_start + args.time_limit
    out_path = args.out or out_dir() / "moe_bench.json"
    results = {"date": now(), "hardware": hardware(), "args": vars(args), "cells": [],
               "note": "random routers route almost uniformly; see 'skewed' for a biased router"}
    shared = shared_read_bandwidth()
    bw = {"h2d": h2d_bandwidth(), "cpu_read": cpu_read_bandwidth(), "shared_total": shared["total"]}
    results["bandwidth_gb_s"] = {k: v / 1e9 for k, v in bw.items()}
    model = shape_model(args.shape)
    t0 = time.perf_counter()
    host = random_packed(model)
    results["build_s"] = time.perf_counter() - t0
    results["model_gib"] = model.nbytes / GiB
    log.info("%s: %.1f GiB built and pinned in %.1f s; bandwidth %s", args.shape, model.nbytes / GiB,
             results["build_s"], results["bandwidth_gb_s"])
    profile, results["profile_source"] = bench_profile(args.profile, model.dtype)
    results["profile"] = profile.summary()
    budgets = [int(float(b) * GiB) for b in args.budgets.split(",")]
    for budget in budgets:
        for label, placement, cache, options in in_order(placements_for(model, budget, args, profile), args.placements):
            cell = run_cell(model, host, label, placement, cache, budget, args, bw, deadline, options, profile)
            log.info("%s", cell)
            results["cells"].append(cell)
            write_json(out_path, results)
    if not args.no_skewed:  # skewed routing: the cache's hit rate and decode speed at the largest budget
        skew_routing(model, host)
        budget = budgets[-1]
        for label, placement, cache, options in placements_for(model, budget, args, profile)[1:2]:  # experts-stream
            args_skew = argparse.Namespace(**{**vars(args), "batches": "", "decode_steps": 3 * args.decode_steps})
            cell = run_cell(model, host, label + " (skewed routing)", placement, cache, budget, args_skew, bw,
                            deadline + 60, options)
            results["skewed"] = cell
            log.info("skewed: %s", cell)
    results["total_s"] = time.perf_counter() - t_start
    write_json(out_path, results)
    sync()


if __name__ == "__main__":
    main()
