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
says so once in the log and returns None, for the caller's own path. Each first compilation runs
under :func:`compile_settings`.

Inductor's CPU kernels hold the GIL while they run (ATen's release it). A thread that must leave
the GIL to another while it computes — the run-ahead worker, beside the host thread that queues
GPU work — runs its work inside :func:`gil_kept_free`, and :func:`allowed` is False there.
"""

from __future__ import annotations

import contextlib
import logging
import os
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


_trust_isa_flags = True  # until a compilation under the instruction set the CPU's flags name fails


def compile_settings():
    """Inductor's settings while these kernels compile, and whether they trust the CPU's flags.

    The CPU's vector instruction set is taken from the flags torch reads (cpuinfo) instead of proven
    by building and loading a test library for each candidate set, and the C++ is built in this
    process instead of by a pool of worker processes started for it. On the 2-core development
    machine a process's first compilation took 14.5-18.5 s, 7.2 s without the probes and 5.5 s
    without the pool too; a cold quick profile 66-73 s against 54-56 s (the probes are remembered
    by the process, and by inductor's cache on disk). What the user set (``TORCHINDUCTOR_VEC_ISA_OK``,
    ``TORCHINDUCTOR_COMPILE_THREADS``) stays. Where a compilation fails under the trusted set (a
    compiler that cannot build it), :class:`CompiledKernel` withdraws the trust and compiles again
    with the probes."""
    from torch._inductor import config

    changes = {}
    if _trust_isa_flags and config.cpp.vec_isa_ok is None:
        changes["cpp.vec_isa_ok"] = True
    if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
        changes["compile_threads"] = 1
    return config.patch(changes), "cpp.vec_isa_ok" in changes


def _distrust_isa_flags() -> None:
    """From now on inductor probes the instruction sets (the list it made from the flags is dropped)."""
    global _trust_isa_flags
    _trust_isa_flags = False
    from torch._inductor import cpu_vec_isa

    cache_clear = getattr(getattr(cpu_vec_isa, "valid_vec_isa_list", None), "cache_clear", None)
    if cache_clear is not None:
        cache_clear()


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
                return self._compile_and_call(key, args)
            return compiled(*args)
        except Exception as exc:  # noqa: BLE001 - no compiler, an unsupported op: the caller's path instead
            self.failed = f"{type(exc).__name__}: {_first_line(exc)}"
            log.warning("%s on the CPU %s: compiling their kernel failed (%s)", self.what, self.fallback, self.failed)
            return None

    def _compile_and_call(self, key: tuple, args) -> torch.Tensor:
        """Compile a fresh copy of ``fn`` for ``key`` and call it (torch compiles on the first call),
        under :func:`compile_settings`; once more with probed instruction sets if the trusted one failed."""
        while True:
            fresh = types.FunctionType(self.fn.__code__.replace(), self.fn.__globals__, self.fn.__name__,
                                       self.fn.__defaults__, self.fn.__closure__)
            compiled = self._compiled[key] = torch.compile(fresh, dynamic=True)
            settings, trusted = compile_settings()
            try:
                with settings:
                    return compiled(*args)
            except Exception as exc:  # noqa: BLE001 - re-raised unless the trusted instruction set is to blame
                self._compiled.pop(key, None)
                if not trusted:
                    raise
                log.info("%s: compiling with the instruction set the CPU's flags name failed (%s); probing "
                         "the instruction sets instead", self.what, _first_line(exc))
                _distrust_isa_flags()


def _first_line(exc: Exception) -> str:
    return str(exc).splitlines()[0] if str(exc) else ""
