"""Fixed cost of dispatching one tiny sub-layer (Python + kernel launches) on each side, and of
replaying its kernels from a CUDA graph.

The sub-layer is a norm, two small projections, an activation and a residual on one
token: its arithmetic is negligible, so its time is the per-sub-layer overhead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .timing import host_issue_s, time_wall_cuda

TINY_LAUNCHES = 10  # kernels of one _tiny_sublayer on the GPU
LONG_GRAPH = 32  # tiny sub-layers captured in the long graph of measure_graph_replay


def _tiny_sublayer(x, norm_weight, w_up, w_down):
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_weight
    h = F.silu(F.linear(h, w_up))
    return x + F.linear(h, w_down)


def _tiny_inputs(device: str) -> tuple[torch.Tensor, ...]:
    """(x [T, D], norm weight, up, down) of one token through the tiny sub-layer."""
    return (torch.randn(1, 64, device=device), torch.ones(64, device=device), torch.randn(128, 64, device=device),
            torch.randn(64, 128, device=device))


def measure_dispatch(device: str, budget_s: float) -> float:
    """Seconds per tiny sub-layer on ``device`` ("cpu" or "cuda"), wall clock."""
    inputs = _tiny_inputs(device)
    fn = lambda: _tiny_sublayer(*inputs)  # noqa: E731
    # Dispatch costs a few microseconds and every interruption adds to it: take the fastest
    # of many short batches rather than a median (run-to-run spread was ±50% with 3 batches).
    if device == "cuda":
        return time_wall_cuda(fn, budget_s, batches=15, fastest=True)
    return time_cpu_fastest(fn, budget_s)


def time_cpu_fastest(fn, budget_s: float, batches: int = 15) -> float:
    """Lowest per-call wall time over ``batches`` batches of back-to-back calls."""
    import time

    fn()
    start = time.perf_counter()
    fn()
    single = max(time.perf_counter() - start, 1e-7)
    reps = max(1, int(budget_s / batches / single))
    best = float("inf")
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - start) / reps)
    return best


def measure_graph_replay(budget_s: float) -> dict[str, float]:
    """Host seconds to replay a CUDA graph: ``{"cuda_graph": one replay of one tiny sub-layer's
    TINY_LAUNCHES kernels, "cuda_graph_node": each kernel more}``, from graphs of one and of
    LONG_GRAPH tiny sub-layers. Only the host's issuing is timed (each batch of replays is waited
    for after its clock stops): what a decode step's host thread pays for a run of sub-layers that
    the executor replays (:mod:`~vramshard.runtime.graphs`), its kernels being priced apart."""
    x, *weights = _tiny_inputs("cuda")

    def captured(sublayers: int) -> torch.cuda.CUDAGraph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the default stream, as capture asks
            _tiny_sublayer(x, *weights)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            h = x
            for _ in range(sublayers):
                h = _tiny_sublayer(h, *weights)
        return graph

    def host_s(graph: torch.cuda.CUDAGraph, share: float) -> float:
        graph.replay()
        return host_issue_s(graph.replay, share, batches=15, reps=8)

    one, long = captured(1), captured(LONG_GRAPH)
    single, many = host_s(one, budget_s / 2), host_s(long, budget_s / 2)
    node = (many - single) / ((LONG_GRAPH - 1) * TINY_LAUNCHES)
    return {"cuda_graph": single, "cuda_graph_node": max(node, 1e-9)}  # (the schema takes positive times only)
