"""A MoE layer's routed experts on the CPU in one pass, by rows: its rate in bytes per second.

Up to :data:`~vramshard.layers.host_experts.ROWS` tokens, the executor computes a step's host
experts in one pass over the layer's stacked weights (:mod:`~vramshard.layers.host_experts`): at one
token the C kernel's call where it builds (since session 35), else one compiled pass.
The matmul tables time one projection at a time, and at a decode step's tiny shapes they are off
for the expert-by-expert path too (the fourteenth GPU session: its estimate 1.25-1.77x too fast).
This times the pass with the layer's own code (:meth:`MoEFFN.run_experts` over a stacked source)
over cold weights (experts picked at random among enough of them that the caches hold few), and
records, per row count, the bytes of its assignments (each expert once per assignment, as the pass
reads them) over its time, the call's fixed costs included. The first call compiles and is not
timed (a few seconds on two cores). Profiles measured before session 35 timed the compiled pass at
one token too.

The same pass is timed again as the executor's run-ahead worker runs it (``VRAMSHARD_RUN_AHEAD``):
on a worker thread of one core fewer, while the profiling thread runs Python as the host thread
does when it queues a step. On the H200 machine's host the one-token pass took 1.59 ms there
against 0.76 ms alone (twenty-third GPU session, ``benchmarks.compiled_gil``), and the engine's
CPU share of the zero-copy experts decoded at 15.3 tok/s where the rate alone predicted 22.9.

On the worker the pass is timed as the worker runs it: as one bound C call
(:class:`~vramshard.layers.cpu_gemv.BoundPart`, its ready word already up) where the executor's worker
takes that call (``VRAMSHARD_RUN_AHEAD_ONE_CALL``, since session 47), else the layer's own code as above.

How large the worker's OpenMP team should be is measured too: the one-token pass beside Python with
teams of one core fewer down to a quarter of the cores (:func:`team_candidates`). An OpenMP team waits
at every barrier for its slowest thread, and beside the host thread (Python, then the driver spinning
in its wait for the GPU) a thread that shares a core with it is that slowest one: one thread fewer took
the thirteenth GPU session's run-ahead parts from 210 to 104 ms, and the pass still took 2.3x its time
alone on one core fewer (the twenty-fourth). A one-token pass reads its weights once, so a smaller team
may read them as fast. The planner gives the worker the fastest team (:func:`~vramshard.profile.query.fastest_team`)
and the executor's worker computes decode-sized parts with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..layers import host_experts
from ..layers.moe import DictExperts, MoEFFN, Routing
from ..models import build_model
from ..runtime import run_ahead
from ..runtime.host_weights import pack_sublayer
from .bench_matmul import cold_bytes, cycling
from .progress import ProgressSink
from .query import fastest_team
from .spec import torch_dtype
from .timing import time_cpu, time_cpu_beside_python

ROUTINGS = 16  # random routings cycled through by the timed calls
# The most timed calls of one point: enough for the pass's calls (0.3-2 ms at one token) to fill the point's
# budget. With time_cpu's default of 50 a point was timed over ~20 ms of its 0.3 s on the H100 host, and
# three quick profiles there put the one-token pass at 86, 136 and 127 GB/s (thirty-seventh GPU session).
PASS_REPS = 2000
MAX_EXPERTS = 512


def team_candidates(largest: int) -> list[int]:
    """The worker's OpenMP team sizes to time, largest first: ``largest`` (one core fewer than the
    process's threads: the host thread keeps one), then three quarters, half and a quarter of the cores."""
    cores = largest + 1
    return sorted({max(1, min(largest, count)) for count in (largest, cores * 3 // 4, cores // 2, cores // 4)},
                  reverse=True)


def moe_ffn(hidden: int, intermediate: int, experts: int, top_k: int, dtype: torch.dtype) -> MoEFFN:
    """A Qwen3-MoE FFN sub-layer of these sizes."""
    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": hidden,
              "intermediate_size": 4 * intermediate, "moe_intermediate_size": intermediate, "num_experts": experts,
              "num_experts_per_tok": top_k, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
              "num_hidden_layers": 1, "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 64,
              "vocab_size": 64, "max_position_embeddings": 128, "rms_norm_eps": 1e-6}
    return next(s for s in build_model(config, dtype) if isinstance(s, MoEFFN))


@dataclass
class HostExpertRates:
    """Bytes of a step's assignments per second of the compiled pass: ``alone`` by rows; on the
    run-ahead worker beside Python, ``worker`` by rows (with the fastest team) and ``teams`` by the
    worker's team size (one token). The worker's are empty where it was not measured."""

    alone: dict[str, float]
    worker: dict[str, float] = field(default_factory=dict)
    teams: dict[str, float] = field(default_factory=dict)


def _as_the_worker_runs_it(ffn: MoEFFN, source: DictExperts, h: torch.Tensor, routings: list[Routing]):
    """The pass as the run-ahead worker's one C call for each routing in turn (its ready word already up,
    its ticket raised into a word nobody waits for), where the worker takes that call here; else None."""
    if not run_ahead.ONE_CALL:
        return None
    parts = [ffn.experts_part(source, h, routing, torch.empty_like(h)) for routing in routings]
    if any(part is None for part in parts):
        return None
    ready, ticket = torch.ones(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    return cycling(len(parts), lambda i: parts[i].run(ready, ticket, 1, 0.0, torch.get_num_threads()))


def measure_host_experts(dtype: str, hidden: int, intermediate: int, top_k: int, rows: list[int], budget_s: float,
                         progress: ProgressSink, weight: float, on_worker: bool = False) -> HostExpertRates | None:
    """The pass's rates (:class:`HostExpertRates`; on the run-ahead worker beside Python where
    ``on_worker``); None where the pass does not run here (a dtype it does not take, no C++
    compiler: the executor then runs expert by expert)."""
    progress.step(f"cpu routed experts {dtype} [{hidden} x {intermediate}, top {top_k}]")
    dt = torch_dtype(dtype)
    if dt not in host_experts.DTYPES or not host_experts.ENABLED:
        progress.advance(weight)
        return None
    expert_bytes = 3 * hidden * intermediate * dt.itemsize
    experts = max(4 * top_k, min(MAX_EXPERTS, math.ceil(cold_bytes("cpu") / expert_bytes)))
    ffn = moe_ffn(hidden, intermediate, experts, top_k, dt)
    weights = {spec.source: (torch.randn(spec.shape) * 0.02).to(dt) if len(spec.shape) > 1
               else torch.ones(spec.shape, dtype=dt) for spec in ffn.weights}
    source = DictExperts(pack_sublayer(ffn, weights, pin=False).views, experts, stack=True)
    del weights
    if source.stacked() is None:
        progress.advance(weight)
        return None
    generator = torch.Generator().manual_seed(0)
    rates = HostExpertRates({})
    team = None  # the worker's fastest team, once timed at one token
    with torch.inference_mode():
        for m in rows:
            if m > host_experts.ROWS:
                continue
            h = torch.randn(m, hidden, generator=generator).to(dt)
            routings = [Routing(torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(m)]),
                                torch.full((m, top_k), 1.0 / top_k).to(dt)) for _ in range(ROUTINGS)]
            first = routings[0]
            if host_experts.routed(h, *source.stacked(), first.experts, first.weights) is None:
                break  # (compiles on the first call) it failed to compile: said in the log
            one = cycling(ROUTINGS, lambda i: ffn.run_experts(source, h, routings[i]))
            assigned = m * top_k * expert_bytes
            rates.alone[str(m)] = assigned / time_cpu(one, budget_s, PASS_REPS)
            if not on_worker:
                continue
            one = _as_the_worker_runs_it(ffn, source, h, routings) or one
            if team is None:  # (the first rows measured: one token, as decode steps give the worker)
                for count in team_candidates(run_ahead.largest_team(torch.get_num_threads())):
                    beside = time_cpu_beside_python(one, budget_s, count, run_ahead.SWITCH_INTERVAL_S, PASS_REPS)
                    rates.teams[str(count)] = assigned / beside
                team = fastest_team(rates.teams)
                rates.worker[str(m)] = rates.teams[str(team)]
                continue
            beside = time_cpu_beside_python(one, budget_s, team, run_ahead.SWITCH_INTERVAL_S, PASS_REPS)
            rates.worker[str(m)] = assigned / beside
    progress.advance(weight)
    return rates if rates.alone else None
