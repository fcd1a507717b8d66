"""How the host waits for the GPU right before CPU work of its own.

A split FFN's CPU part starts when the GPU has normalized the layer's input and copied it to
the host. By default the host blocks on that CUDA event, and OpenMP's worker threads sit idle
meanwhile. ``VRAMSHARD_CPU_WAIT=keep-warm`` instead polls the event while running a small
parallel op, so the workers keep spinning and the first matmul after the wait does not pay for
waking them (a suspect for the split FFN's slow first CPU matmul on the H200 machine;
``benchmarks/idle_wake.py`` measures whether it is). It burns the CPU time it waits.
"""

from __future__ import annotations

import os

import torch

CPU_WAITS = ("block", "keep-warm")
CPU_WAIT = os.environ.get("VRAMSHARD_CPU_WAIT", "block").lower()
if CPU_WAIT not in CPU_WAITS:
    raise ValueError(f"VRAMSHARD_CPU_WAIT must be one of {', '.join(CPU_WAITS)}, got {CPU_WAIT!r}")

_WARM_ELEMENTS = 1 << 19  # float32: 2 MiB, enough chunks for every OpenMP thread of a desktop CPU
_scratch: torch.Tensor | None = None


def wait_for_gpu(event: torch.cuda.Event) -> None:
    """Return once ``event`` has completed, the way ``VRAMSHARD_CPU_WAIT`` says."""
    global _scratch
    if CPU_WAIT == "block" or event.query():
        event.synchronize()
        return
    if _scratch is None:
        _scratch = torch.zeros(_WARM_ELEMENTS)
    while not event.query():
        _scratch.add_(1.0)
