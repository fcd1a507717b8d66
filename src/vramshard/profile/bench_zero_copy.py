"""The GPU's kernels reading routed experts straight from pinned host memory, against the copy engine.

A decode step may compute its routed experts on the GPU from host memory without copying them in
(:mod:`~vramshard.runtime.zero_copy_experts`: the kernels read the weights through the GPU's mapping
of the pinned buffer). How fast that read goes is the machine's: 92% of the copy engine's rate on
the H200 machine (thirteenth GPU session), 61-63% on the H100 machine (thirty-third, whatever the host
pages). The estimator prices those reads at the measured share (the profile's ``zero_copy``).
"""

from __future__ import annotations

import torch

from .progress import ProgressSink
from .timing import time_cuda

EXPERTS, HIDDEN, WIDTH, TOP_K = 16, 2048, 768, 8  # a Qwen3-30B-A3B-sized expert, one token's eight


def measure_zero_copy(*, budget_s: float, progress: ProgressSink, weight: float) -> dict | None:
    """``{"bytes", "seconds", "copy_seconds"}``: one token's routed experts (``TOP_K`` of ``EXPERTS``
    bf16 experts of Qwen3-30B-A3B's shape, in the executor's pinned host memory) computed by the
    zero-copy kernels, and the copy engine's copy of the same bytes; None where those kernels do not
    run here (no Triton)."""
    from ..layers.moe import Routing, StackedExperts
    from ..runtime import pinned_host, zero_copy_experts

    if not zero_copy_experts.available():
        return None
    progress.step("zero-copy expert reads")
    dtype, gpu = torch.bfloat16, torch.device("cuda")

    def pinned(shape) -> torch.Tensor:
        numel = torch.Size(shape).numel()
        return pinned_host.pinned_empty(numel * dtype.itemsize).view(dtype).view(shape).normal_(0.0, 0.02)

    stacked = StackedExperts(pinned((EXPERTS, 2 * WIDTH, HIDDEN)), pinned((EXPERTS, HIDDEN, WIDTH)))
    if not (stacked.gate_up.is_pinned() and stacked.down.is_pinned()):
        return None  # (pinning failed: the kernels cannot read pageable memory)
    chosen = torch.randperm(EXPERTS, device=gpu)[:TOP_K].view(1, TOP_K)
    routing = Routing(chosen, torch.full((1, TOP_K), 1.0 / TOP_K, dtype=dtype, device=gpu))
    h = torch.randn(1, HIDDEN, dtype=dtype, device=gpu)
    routed = TOP_K * 3 * WIDTH * HIDDEN * dtype.itemsize
    seconds = time_cuda(lambda: zero_copy_experts.routed_experts(stacked, h, routing), budget_s)
    source = stacked.gate_up.view(-1).view(torch.uint8)[:routed]
    staging = torch.empty(routed, dtype=torch.uint8, device=gpu)
    copy_seconds = time_cuda(lambda: staging.copy_(source, non_blocking=True), budget_s)
    progress.advance(weight)
    return {"bytes": routed, "seconds": seconds, "copy_seconds": copy_seconds}
