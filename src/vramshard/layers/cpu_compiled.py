"""CPU kernels that ``torch.compile`` (inductor) makes from a few lines of torch, for decode-sized work.

At one to a few tokens, half-precision products on the CPU are matrix-vector work that ATen's
paths run well below the memory bus on some CPUs (on this project's 2-core AMD EPYC a
Qwen3-30B-A3B layer's 8 experts of one token took 7.05 ms expert by expert, 2.61 ms in one
compiled pass, against 2.26 ms to read them: ``benchmarks/cpu_experts``). Inductor turns a
multiply-and-sum over the weight into one vectorized, OpenMP-parallel loop nest that reads each
weight once.

:class:`CompiledKernel` compiles its function on first use, with shapes symbolic (torch recompiles
for a new weight layout, and once for size-1 dimensions; a new dtype or thread count gets a
compilation of its own). From its first failure (no C++ compiler, an unsupported operation) it
says so once in the log and returns None, for the caller's own path.

Inductor's CPU kernels hold the GIL while they run (ATen's release it). A thread that must leave
the GIL to another while it computes — the run-ahead worker, beside the host thread that queues
GPU work — runs its work inside :func:`gil_kept_free`, and :func:`allowed` is False there.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import types
from typing import Callable

import torch

log = logging.getLogger(__name__)

_local = threading.local()


@contextlib.contextmanager
def gil_kept_free():
    """Within: this thread does not run compiled CPU kernels (they would hold the GIL)."""
    before = getattr(_local, "gil_free", False)
    _local.gil_free = True
    try:
        yield
    finally:
        _local.gil_free = before


def allowed() -> bool:
    """Whether this thread may run compiled CPU kernels now."""
    return not getattr(_local, "gil_free", False)


class CompiledKernel:
    """``fn`` through ``torch.compile`` (shapes symbolic), or None from its first failure on.

    One compiled function per (dtype of the first argument, thread count), each over its own copy
    of ``fn``'s code: torch keeps at most ``recompile_limit`` (8) compilations per code object and
    runs the function eagerly beyond them, and eagerly these few lines make float32 copies of the
    weights. A profile alone times 10 (dtype, thread count) pairs."""

    def __init__(self, fn: Callable[..., torch.Tensor], what: str, fallback: str):
        self.fn = fn
        self.what, self.fallback = what, fallback  # for the log: "routed experts", "run expert by expert"
        self._compiled: dict[tuple, Callable[..., torch.Tensor]] = {}
        self.failed: str | None = None

    def __call__(self, *args) -> torch.Tensor | None:
        if self.failed is not None:
            return None
        try:
            key = (args[0].dtype, torch.get_num_threads())
            compiled = self._compiled.get(key)
            if compiled is None:
                fresh = types.FunctionType(self.fn.__code__.replace(), self.fn.__globals__, self.fn.__name__,
                                           self.fn.__defaults__, self.fn.__closure__)
                compiled = self._compiled[key] = torch.compile(fresh, dynamic=True)
            return compiled(*args)
        except Exception as exc:  # noqa: BLE001 - no compiler, an unsupported op: the caller's path instead
            self.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            log.warning("%s on the CPU %s: compiling their kernel failed (%s)", self.what, self.fallback, self.failed)
            return None
