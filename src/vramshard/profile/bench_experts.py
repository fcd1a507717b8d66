"""A MoE layer's routed experts on the CPU: the compiled pass against the expert-by-expert path, by rows.

Up to :data:`~vramshard.layers.host_experts.ROWS` tokens, the executor computes a step's host
experts in one compiled pass over the layer's stacked weights (:mod:`~vramshard.layers.host_experts`).
The matmul tables time one projection at a time, as the expert-by-expert path runs them. This
measures the pass's time over that path's with the layer's own code (:meth:`MoEFFN.run_experts`
over a stacked and an unstacked source), over cold weights (experts picked at random among enough
of them that the caches hold few), as a factor per row count that the estimator applies to
experts on the CPU. The first call compiles and is not timed (a few seconds on two cores).
"""

from __future__ import annotations

import math

import torch

from ..layers import host_experts
from ..layers.moe import DictExperts, MoEFFN, Routing
from ..models import build_model
from ..runtime.host_weights import pack_sublayer
from .bench_matmul import cold_bytes, cycling
from .progress import ProgressSink
from .spec import torch_dtype
from .timing import time_cpu

ROUTINGS = 16  # random routings cycled through by the timed calls
MAX_EXPERTS = 512


def moe_ffn(hidden: int, intermediate: int, experts: int, top_k: int, dtype: torch.dtype) -> MoEFFN:
    """A Qwen3-MoE FFN sub-layer of these sizes."""
    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": hidden,
              "intermediate_size": 4 * intermediate, "moe_intermediate_size": intermediate, "num_experts": experts,
              "num_experts_per_tok": top_k, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
              "num_hidden_layers": 1, "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 64,
              "vocab_size": 64, "max_position_embeddings": 128, "rms_norm_eps": 1e-6}
    return next(s for s in build_model(config, dtype) if isinstance(s, MoEFFN))


def measure_host_experts(dtype: str, hidden: int, intermediate: int, top_k: int, rows: list[int], budget_s: float,
                         progress: ProgressSink, weight: float) -> dict[str, float] | None:
    """{rows: compiled pass time over the expert-by-expert path's}; None where the pass does not
    run here (a dtype it does not take, no C++ compiler: the executor then runs expert by expert)."""
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
    views = pack_sublayer(ffn, weights, pin=False).views
    del weights
    plain, stacked = DictExperts(views, experts), DictExperts(views, experts, stack=True)
    if stacked.stacked() is None:
        progress.advance(weight)
        return None
    generator = torch.Generator().manual_seed(0)
    factors: dict[str, float] = {}
    with torch.inference_mode():
        for m in rows:
            if m > host_experts.ROWS:
                continue
            h = torch.randn(m, hidden, generator=generator).to(dt)
            routings = [Routing(torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(m)]),
                                torch.full((m, top_k), 1.0 / top_k).to(dt)) for _ in range(ROUTINGS)]
            ffn.run_experts(stacked, h, routings[0])  # compiles (once per process and dtype)
            if host_experts.routed(h, *stacked.stacked(), routings[0].experts, routings[0].weights) is None:
                break  # it failed to compile: said in the log
            t_plain = time_cpu(cycling(ROUTINGS, lambda i: ffn.run_experts(plain, h, routings[i])), budget_s)
            t_pass = time_cpu(cycling(ROUTINGS, lambda i: ffn.run_experts(stacked, h, routings[i])), budget_s)
            factors[str(m)] = t_pass / t_plain
    progress.advance(weight)
    return factors or None
