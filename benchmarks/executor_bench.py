"""Executor benchmark: every named placement at several VRAM budgets on real shapes.

    PYTHONPATH=src python -m benchmarks.executor_bench --models nemo-8b,llama3-8b --budgets 2,4,8

For each model (random weights, built in memory) and placement × budget: decode tok/s
at a 1K context, time to first token for a 1K prompt, peak VRAM
(``torch.cuda.max_memory_reserved``), and the physical bound of one decode step,
(model bytes − resident bytes) / (PCIe bandwidth + CPU memory bandwidth), with both
bandwidths measured in the same run. Also the two overlap checks of the Executor issue:
streamed bytes per second during a 1K prefill with ``stream``, and ``static`` decode
against CPU-FFN time + GPU-attention time measured separately.

``--graphs`` adds a ``gpu+graphs`` cell beside the plain ``gpu`` cell, from the same executor:
decode replayed from CUDA graphs (:class:`~vramshard.runtime.graphs.DecodeGraphs`). Both cells
report the HBM bound of a decode step, resident bytes / ``--hbm-gb-s``, and the fraction of it reached.
"""

from __future__ import annotations

import argparse
import gc
import logging
import time

import torch

from vramshard.errors import BudgetError
from vramshard.layers.step import Step
from vramshard.plan.memory import max_resident_layers, sublayer_triples
from vramshard.plan.placement import named_placement
from vramshard.runtime.executor import Executor
from vramshard.runtime.graphs import DecodeGraphs
from vramshard.runtime.host_weights import pack_model
from vramshard.runtime.wire_codec import wire_ratio
from vramshard.shapes import random_weights, shape_model

from .common import coded_link, cpu_read_bandwidth, h2d_bandwidth, hardware, now, out_dir, timed, write_json

log = logging.getLogger("executor_bench")
GiB = 2**30


def fill_kv(kv, context: int) -> None:
    kv.fill_random(context)


def decode_seconds(executor: Executor, context: int, steps: int) -> float:
    kv = executor.new_kv_cache(1, context + steps + 2)
    fill_kv(kv, context)
    token = torch.tensor([11])
    state = {"pos": context}

    def one():
        executor.forward(token, Step.single(state["pos"], 1, kv_lookup=kv))
        state["pos"] += 1

    return timed(one, repeat=steps, warmup=2)


def graph_decode_seconds(executor: Executor, graphs: DecodeGraphs, context: int, steps: int) -> float:
    """As :func:`decode_seconds`, each step replayed from the graphs as the executor's GPU path would
    run it (on its compute stream, under its lock, logits copied to the host)."""
    kv = executor.new_kv_cache(1, context + steps + 4)
    fill_kv(kv, context)
    token = torch.tensor([11])
    state = {"pos": context}
    sublayers = executor.token_sublayers
    compute = executor.compute_stream

    @torch.inference_mode()
    def one():
        with executor.lock:
            compute.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(compute):
                out = graphs.run(sublayers, token, Step.single(state["pos"], 1, kv_lookup=kv))
                if out is None:
                    raise RuntimeError(f"decode graphs did not cover the step: {graphs.stats.fallbacks}")
                out.cpu()
        state["pos"] += 1

    return timed(one, repeat=steps, warmup=2)


def hbm_bound(cell: dict, resident: int, args) -> None:
    """Tokens/s if a decode step only read the resident weights at HBM speed, and the fraction reached."""
    cell["hbm_bound_tok_s"] = args.hbm_gb_s * 1e9 / resident
    cell["hbm_fraction"] = cell["decode_tok_s"] / cell["hbm_bound_tok_s"]


def graph_cell(executor: Executor, cell: dict, args, compile_backend: str | None = None) -> dict:
    """The ``gpu+graphs`` cell (``gpu+graphs+compile`` with a torch.compile backend), from the
    executor of the plain ``gpu`` cell."""
    graphs = DecodeGraphs(executor.resident, executor.gpu, executor.kv_plan[1], compile_backend=compile_backend)
    label = "gpu+graphs" + ("+compile" if compile_backend else "")
    graph = {"placement": label, "budget_gib": cell["budget_gib"], "resident_gib": cell["resident_gib"]}
    t0 = time.perf_counter()
    step = graph_decode_seconds(executor, graphs, args.ctx, max(args.decode_steps, 16))
    graph["first_steps_s"] = time.perf_counter() - t0  # compiling and capturing included
    graph["decode_tok_s"] = 1 / step
    hbm_bound(graph, executor.need.resident, args)
    graph["graphs_captured"] = graphs.stats.captures
    graph["graph_capture_s"] = graphs.stats.capture_seconds
    graph["graph_pool_mib"] = graphs.pool_bytes / 2**20
    graph["speedup_vs_eager"] = graph["decode_tok_s"] / cell["decode_tok_s"]
    del graphs
    return graph


def prefill_seconds(executor: Executor, prompt: int) -> float:
    kv = executor.new_kv_cache(1, prompt + 1)
    ids = torch.randint(0, 1000, (prompt,))
    return timed(lambda: executor.forward(ids, Step.single(0, prompt, kv_lookup=kv)), repeat=2, warmup=1)


def run_cell(model, host, spec, budget, args, bw, extra: list | None = None) -> dict:
    """One placement × budget; with ``extra`` (a list) and ``--graphs``, the ``gpu`` cell appends its
    ``gpu+graphs`` cell there."""
    triples, layers = sublayer_triples(model), model.args.num_hidden_layers
    kv_tokens = args.ctx + args.prompt + 64
    most = max_resident_layers(model, budget, 1, kv_tokens, args.prompt) if budget else layers
    placement = named_placement(spec, triples, layers, most)
    cell = {"placement": placement.name, "budget_gib": budget / GiB if budget else None}
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_reserved()
    try:
        executor = Executor(model, host, placement, budget=budget, max_tokens=args.prompt,
                            max_context=kv_tokens, num_slots=args.slots, threads=args.threads)
    except BudgetError as exc:
        cell["error"] = str(exc)
        return cell
    resident = executor.need.resident
    non_resident = model.nbytes - resident
    link = coded_link(bw, wire_ratio(model.dtype) if executor.wire_codec else 1.0)  # (coded fills carry more)
    cell["bound_tok_s"] = (link["h2d"] + link["cpu_read"]) / max(non_resident, 1) if non_resident else None
    cell["resident_gib"] = resident / GiB
    step = decode_seconds(executor, args.ctx, args.decode_steps)
    cell["decode_tok_s"] = 1 / step
    cell["decode_bytes_streamed"] = executor.report.bytes_streamed
    if placement.name == "gpu":
        hbm_bound(cell, resident, args)
        if args.graphs and extra is not None:
            extra.append(graph_cell(executor, cell, args))
        if args.compile and extra is not None:
            extra.append(graph_cell(executor, cell, args, compile_backend=args.compile))
    # TTFT: a quick probe first, so CPU-heavy placements do not eat the time limit.
    probe = prefill_seconds(executor, 128)
    if probe * args.prompt / 128 > args.max_prefill_s:
        cell["ttft_s"] = None
        cell["ttft_note"] = f"skipped: a 128-token prefill took {probe:.1f} s"
    else:
        cell["ttft_s"] = prefill_seconds(executor, args.prompt)
        cell["prefill_bytes_streamed"] = executor.report.bytes_streamed
        if executor.report.bytes_streamed:
            cell["prefill_stream_gb_s"] = executor.report.bytes_streamed / cell["ttft_s"] / 1e9
    if placement.name == "static":
        cell.update(static_parts(executor, args.ctx))
        cell["static_step_s"] = step
    cell["peak_vram_gib"] = (torch.cuda.max_memory_reserved() - base) / GiB
    cell["within_budget"] = budget is None or torch.cuda.max_memory_reserved() - base <= budget
    del executor
    return cell


@torch.inference_mode()
def down_layout_check(model) -> dict:
    """CPU time of the FFN down projection with down_proj as checkpoints store it ([D, F]) and as
    the split-FFN layout stores it ([F, D], used transposed), at 1 and 16 tokens: does the layout
    that lets plans split FFNs cost CPU time?"""
    d, f = model.args.hidden_size, model.args.intermediate_size
    stored = torch.randn(d, f, dtype=model.dtype) * 0.02  # [D, F]
    transposed = stored.t().contiguous()  # [F, D]
    out = {}
    for tokens in (1, 16):
        x = torch.randn(tokens, f, dtype=model.dtype)
        for label, weight in (("stored", stored), ("transposed", transposed.t())):
            out[f"{label}_T{tokens}_ms"] = timed(lambda: torch.nn.functional.linear(x, weight), repeat=9,
                                                 warmup=2) * 1e3
    return out


@torch.inference_mode()
def static_parts(executor: Executor, context: int) -> dict:
    """CPU-FFN time, GPU-attention time and the rest of the CPU work (embedding, head) of one
    decode step, each measured apart: ``static`` computes the head on the CPU too (a GEMV over
    the whole vocabulary, ~1 GiB for these shapes), which belongs to its work, not its overhead."""
    model = executor.model
    kv = executor.new_kv_cache(1, context + 8)
    fill_kv(kv, context)
    step = Step.single(context, 1, kv_lookup=kv)
    x_cpu = torch.randn(1, model.args.hidden_size, dtype=model.dtype) * 0.1
    x_gpu = x_cpu.cuda()
    ffns = [s for s in model if s.kind == "ffn"]
    attns = [s for s in model if s.kind == "attn"]
    head, embed = model["head"], model["embed"]

    def cpu_rest():
        embed.forward(executor.host["embed"].views, torch.tensor([11]), step)
        head.forward(executor.host["head"].views, x_cpu, step)

    def cpu_ffn():
        x = x_cpu
        for s in ffns:
            x = s.forward(executor.host[s.name].views, x, step)

    executor.compute_stream.wait_stream(torch.cuda.current_stream())

    def gpu_attn():
        with torch.cuda.stream(executor.compute_stream):
            x = x_gpu
            for s in attns:
                x = s.forward(executor.resident[s.name], x, step)
        executor.compute_stream.synchronize()

    ffn_s, attn_s = timed(cpu_ffn, repeat=5, warmup=1), timed(gpu_attn, repeat=5, warmup=1)
    rest_s = timed(cpu_rest, repeat=5, warmup=1)
    return {"static_cpu_ffn_s": ffn_s, "static_gpu_attn_s": attn_s, "static_cpu_embed_head_s": rest_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="nemo-8b,llama3-8b")
    parser.add_argument("--budgets", default="2,4,8", help="GiB, comma-separated")
    parser.add_argument("--placements", default="layers:max,stream,static")
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--decode-steps", type=int, default=6)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--max-prefill-s", type=float, default=40.0)
    parser.add_argument("--skip-cpu", action="store_true", help="skip the all-CPU placement")
    parser.add_argument("--graphs", action="store_true", help="add a gpu+graphs cell (decode from CUDA graphs)")
    parser.add_argument("--compile", default=None, metavar="BACKEND",
                        help="add a gpu+graphs+compile cell: the graphs' fusable parts through torch.compile "
                             "with this backend (e.g. inductor)")
    parser.add_argument("--hbm-gb-s", type=float, default=4800.0, help="HBM bandwidth for the decode bound (H200)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    t_start = time.perf_counter()
    results = {"date": now(), "hardware": hardware(), "args": vars(args), "models": {}}
    bw = {"h2d": h2d_bandwidth(), "cpu_read": cpu_read_bandwidth()}
    results["bandwidth_gb_s"] = {k: v / 1e9 for k, v in bw.items()}
    log.info("bandwidth: %s", results["bandwidth_gb_s"])
    for name in args.models.split(","):
        model = shape_model(name)
        t0 = time.perf_counter()
        # Named placements split no FFN: keep every tensor as the checkpoint stores it.
        host = pack_model(list(model), random_weights(model), pin=True, splittable=False)
        log.info("%s: %.1f GiB built and pinned in %.1f s", name, model.nbytes / GiB, time.perf_counter() - t0)
        results.setdefault("down_proj_layouts", {})[name] = down_layout_check(model)
        log.info("down_proj as stored vs transposed (split layout), CPU: %s", results["down_proj_layouts"][name])
        graph_cells: list[dict] = []
        cells = [run_cell(model, host, "gpu", None, args, bw, graph_cells)]
        log.info("%s", cells[-1])
        for graph in graph_cells:
            cells.append(graph)
            log.info("%s", graph)
        for budget in args.budgets.split(","):
            for spec in args.placements.split(","):
                cells.append(run_cell(model, host, spec, int(float(budget) * GiB), args, bw))
                log.info("%s", cells[-1])
                results["models"][name] = {"bytes": model.nbytes, "cells": cells}
                write_json(args.out or out_dir() / "executor_bench.json", results)
        if not args.skip_cpu:
            cells.append(run_cell(model, host, "cpu", None, args, bw))
            log.info("%s", cells[-1])
        results["models"][name] = {"bytes": model.nbytes, "cells": cells}
        write_json(args.out or out_dir() / "executor_bench.json", results)
        del host
        gc.collect()
    results["elapsed_s"] = time.perf_counter() - t_start
    write_json(args.out or out_dir() / "executor_bench.json", results)


if __name__ == "__main__":
    main()
