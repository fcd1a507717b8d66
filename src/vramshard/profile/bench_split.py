"""The CPU part of a split dense FFN, per byte, against the whole FFN on the CPU.

A dense FFN split between the CPU and the GPU computes its pieces ``0..k-1`` on the CPU from the
split layout (gate and up rows sliced, ``down_proj`` stored transposed so the GPU part streams
as a few contiguous ranges). Those slices are not the contiguous weights the matmul tables
time: on a 2-core machine the part took 1.2x (fp16) to 1.5x (bf16) the whole FFN's time per
byte. This measures that factor with the executor's own code (:meth:`DenseFFN.pieces_of`,
:meth:`DenseFFN.contribution`, and since session 28 the row-major copy of the part's down where the
executor would make one: :mod:`~vramshard.runtime.cpu_down`) for one token over cold weights; the
estimator scales the CPU part's matmul time by it.
"""

from __future__ import annotations

import math

import torch

from ..layers.mlp import DenseFFN
from ..models import build_model
from ..runtime.cpu_down import DownCopies
from ..runtime.host_weights import pack_sublayer
from .bench_matmul import cold_bytes, cycling, settled
from .progress import ProgressSink
from .spec import torch_dtype
from .timing import time_cpu

SHARES = (4, 8, 12)  # pieces of 16 on the CPU
MAX_LAYERS = 8


def split_ffn(hidden: int, intermediate: int, dtype: torch.dtype) -> DenseFFN:
    """A dense FFN sub-layer of these sizes (Llama layout), split into the default pieces."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": intermediate, "num_hidden_layers": 1, "num_attention_heads": 8,
              "num_key_value_heads": 8, "vocab_size": 64, "max_position_embeddings": 128, "rms_norm_eps": 1e-5}
    return next(s for s in build_model(config, dtype) if isinstance(s, DenseFFN))


def measure_split_part(dtype: str, hidden: int, intermediate: int, budget_s: float,
                       progress: ProgressSink, weight: float) -> float:
    """Time per byte of the CPU part over the whole FFN's, the mean over k in :data:`SHARES`."""
    progress.step(f"cpu split FFN part {dtype} [{hidden} x {intermediate}]")
    dt = torch_dtype(dtype)
    ffn = split_ffn(hidden, intermediate, dt)
    layer_bytes = 3 * hidden * intermediate * dt.itemsize
    layers = max(2, min(MAX_LAYERS, math.ceil(cold_bytes("cpu") / layer_bytes)))  # cycled: cold reads
    whole, split = [], []
    for _ in range(layers):
        weights = {spec.source: (torch.randn(spec.shape) * 0.02).to(dt) if len(spec.shape) > 1
                   else torch.ones(spec.shape, dtype=dt) for spec in ffn.weights}
        whole.append(pack_sublayer(ffn, weights, pin=False, splittable=False).views)
        split.append(pack_sublayer(ffn, weights, pin=False, splittable=True).views)
    x = torch.randn(1, hidden).to(dt)
    h = ffn.norm(whole[0], x)
    with torch.inference_mode():
        t_whole = time_cpu(settled(cycling(layers, lambda i: ffn.contribution(whole[i], h))), budget_s)
        ratios = []
        copies = DownCopies()  # the part's down row-major, as the executor reads it (where allowed)
        for k in SHARES:
            parts = [copies.part(f"layer {i}", k, ffn.pieces_of(split[i], 0, k)) for i in range(layers)]
            t_part = time_cpu(settled(cycling(layers, lambda i: ffn.contribution(parts[i], h))), budget_s)
            ratios.append(t_part / (t_whole * k / ffn.num_pieces))
            copies.keep(set())
    progress.advance(weight)
    return sum(ratios) / len(ratios)
