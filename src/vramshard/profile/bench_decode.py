"""The GPU's decode of coded weights (:mod:`~vramshard.runtime.wire_codec`'s blocks), the rate pinned weights kept
coded in VRAM cost each step (:mod:`~vramshard.runtime.vram_coded`).

One llama3-8b FFN's worth of bf16 weights (352 MB), coded on the GPU, decoded by the Triton kernel into a
buffer of its raw size. The estimator prices each coded pin's decode at this rate (the profile's ``vram_decode``);
profiles without it take :data:`~vramshard.plan.estimator.DECODE_SHARE` of the GPU's one-row read.
"""

from __future__ import annotations

import torch

from .progress import ProgressSink
from .timing import time_cuda

RAW_BYTES = 3 * 4096 * 14336 * 2  # a llama3-8b FFN's three projections in bf16


def measure_vram_decode(*, budget_s: float, progress: ProgressSink, weight: float) -> dict | None:
    """``{"bytes", "seconds"}``: raw bytes one decode of coded blocks rebuilds, and its seconds; None where the
    kernel does not run here (no Triton)."""
    from ..runtime import wire_codec

    if wire_codec.triton is None:
        return None
    progress.step("decode of coded weights in VRAM")
    words = (torch.randn(RAW_BYTES // 2, device="cuda") * 0.02).to(torch.bfloat16).view(torch.int16)
    blocks = words.numel() // wire_codec.BLOCK
    coded = torch.empty(blocks * wire_codec.CODED_BLOCK, dtype=torch.uint8, device="cuda")
    wire_codec.code_blocks(words.view(torch.uint8), coded, "cuda", float("inf"))
    out = torch.empty(blocks * wire_codec.BLOCK, dtype=torch.int16, device="cuda")
    seconds = time_cuda(lambda: wire_codec.decode_into(coded, out), budget_s)
    exact = bool(torch.equal(out, words[: out.numel()]))  # (random weights: no block overflows)
    progress.advance(weight)
    if not exact:
        raise RuntimeError("the decode of coded weights gave other words back")
    return {"bytes": blocks * wire_codec.BLOCK_BYTES, "seconds": seconds}
