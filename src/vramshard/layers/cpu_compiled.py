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

Inductor's CPU kernels hold the GIL while they run (ATen's release it): its Python binding calls
the kernel without leaving the interpreter. :func:`kernels_release_gil` changes that binding, for
the kernels this process compiles from then on, to read its arguments with the GIL and release it
around the kernel itself, which touches no Python object. On the 2-core development machine a
Python thread beside a Qwen3-30B-A3B layer's compiled expert pass on a worker ran at 0.63 of its
pace alone before, 1.37-1.65 after (``python -m benchmarks.compiled_gil``, session 24); beside a
200 ms kernel, 0.03 before. Where this torch's binding is not the one it knows, or
with ``VRAMSHARD_CPU_KERNELS_RELEASE_GIL=off``, the kernels keep the GIL, and a thread that must
leave the GIL to another while it computes — the run-ahead worker, beside the host thread that
queues GPU work — runs its work inside :func:`gil_kept_free`, where :func:`allowed` is False.

Inductor writes the thread count of the compilation into a kernel's OpenMP loops (``num_threads(N)``),
and its cache of compiled graphs (in the process and on disk) did not key on that count before
torch's fix of pytorch/pytorch#160812 (May 2026; the development machine's torch 2.13 has it): a
graph compiled once on one thread was served to a later compilation for sixteen, which then ran on
one. That is the likely cause of the twenty-fourth GPU session's slow expert pass on the run-ahead
worker (torch 2.11 there; an executor in the same process had compiled the pass for one thread).
:func:`kernels_read_threads_at_run_time` makes the kernels this process compiles read the calling
thread's count when they run instead (inductor's ``cpp.dynamic_threads``), so a kernel from the
cache is right for every caller.
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


def beside_host() -> bool:
    """Whether this thread shares the GIL with a host thread that runs Python meanwhile (it is
    within :func:`gil_kept_free`: the run-ahead worker)."""
    return getattr(_local, "gil_free", False)


def allowed() -> bool:
    """Whether this thread may run compiled CPU kernels now: anywhere once they release the GIL,
    else outside :func:`gil_kept_free`."""
    return kernels_release_gil() or not getattr(_local, "gil_free", False)


# The binding's call of the kernel, as inductor writes it and with the GIL released around the kernel:
# the arguments are read first, with the GIL (they are Python objects); a guard takes the GIL back
# when the kernel returns or throws (the binding's catch sets a Python error).
_HOLDING = "kernel({}); Py_RETURN_NONE;"
_RELEASING = ("{{ auto vramshard_args = std::make_tuple({}); "
              "struct vramshard_unlocked {{ PyThreadState* saved = PyEval_SaveThread(); "
              "~vramshard_unlocked() {{ PyEval_RestoreThread(saved); }} }}; "
              "{{ vramshard_unlocked unlocked; std::apply(kernel, vramshard_args); }} }} Py_RETURN_NONE;")
_RELEASES_GIL: list[bool] = []  # [whether compiled kernels release the GIL], once decided
_decide = threading.Lock()


def kernels_release_gil(again: bool = False) -> bool:
    """Make inductor's CPU kernels compiled in this process from now on release the GIL while they
    run (once, or ``again`` after :func:`_restore_binding`; see the module). False where they keep it:
    switched off, or a binding of another form than this knows (then nothing is changed)."""
    if _RELEASES_GIL and not again:
        return _RELEASES_GIL[0]
    with _decide:
        if again:
            _RELEASES_GIL[:] = [_patch_binding()]
        elif not _RELEASES_GIL:
            _RELEASES_GIL.append(_patch_binding())
    return _RELEASES_GIL[0]


def _patch_binding() -> bool:
    from ..env import switch

    if not switch("VRAMSHARD_CPU_KERNELS_RELEASE_GIL", default=True):
        return False
    try:
        from torch._inductor import codecache
    except ImportError:  # (no inductor: nothing is compiled)
        return False
    binding = getattr(codecache, "CppPythonBindingsCodeCache", None)
    template = getattr(binding, "suffix_template", "")
    if getattr(binding, "call_entry_function", None) == _RELEASING:
        return True
    if getattr(binding, "call_entry_function", None) != _HOLDING or "#include <sstream>" not in template \
            or "{call_entry_func}" not in template:
        log.info("compiled CPU kernels keep the GIL: this torch's kernel binding is not the one vramshard knows")
        return False
    binding.suffix_template = template.replace("#include <sstream>", "#include <sstream>\n#include <tuple>", 1)
    binding.call_entry_function = _RELEASING
    return True


def _restore_binding() -> bool:
    """Give inductor its own binding back (kernels compiled later keep the GIL); False where it had it."""
    with _decide:
        if not (_RELEASES_GIL and _RELEASES_GIL[0]):
            return False
        from torch._inductor import codecache

        binding = codecache.CppPythonBindingsCodeCache
        binding.call_entry_function = _HOLDING
        binding.suffix_template = binding.suffix_template.replace("#include <sstream>\n#include <tuple>",
                                                                  "#include <sstream>", 1)
        _RELEASES_GIL[0] = False
        return True


def kernels_read_threads_at_run_time() -> bool:
    """Make inductor's CPU kernels compiled in this process from now on take the calling thread's
    OpenMP thread count when they run, not the count they were compiled under (see the module).
    Process-wide, once; left alone where the user set ``TORCHINDUCTOR_CPP_DYNAMIC_THREADS`` or an
    explicit ``cpp.threads``. Returns whether the kernels now read it at run time."""
    try:
        from torch._inductor import config
    except ImportError:  # (no inductor: nothing is compiled)
        return False
    cpp = config.cpp
    if not hasattr(cpp, "dynamic_threads"):
        return False
    if "TORCHINDUCTOR_CPP_DYNAMIC_THREADS" not in os.environ and getattr(cpp, "threads", -1) in (-1, None):
        cpp.dynamic_threads = True
    return bool(cpp.dynamic_threads)


def keep_compiled_in_user_cache() -> str:
    """Have inductor keep what it compiles (C++ kernels, graphs) under vramshard's cache directory
    (:func:`~vramshard.paths.cache_dir`, ``inductor/``) rather than its default under ``/tmp``, which
    many systems empty at each boot: a planned engine's first load compiles its CPU kernels (17.9 s on
    the 2-core development machine against 5.5 s from the cache, ``benchmarks/load_time.py``; 43 s on
    an H100 machine), and the next boot's load should not again. Left alone where
    ``TORCHINDUCTOR_CACHE_DIR`` is set (by the user, or by inductor at its first compilation in this
    process). Returns the directory in use."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        from ..paths import cache_dir

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor")
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


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

    One compiled function per dtype of the first argument, each over its own copy of ``fn``'s code:
    torch keeps at most ``recompile_limit`` (8) compilations per code object and runs the function
    eagerly beyond them, and eagerly these few lines make float32 copies of the weights. Where the
    kernels take the thread count when they run (:func:`kernels_read_threads_at_run_time`), one
    compilation serves every count; else each (dtype, thread count) pair has its own (a profile alone
    times 10 such pairs). Compiled for one count and called at another, a loop nest runs in parallel
    as deep as inductor chose for the first: the kernels written here keep their work in one outer
    loop over rows, which that choice cannot narrow (see :mod:`.host_experts`).

    ``distinct_sizes``: sizes that happen to be equal when torch compiles are not taken to be equal
    ever after (torch's "duck sizing": a compilation whose guards other layers' shapes then fail)."""

    def __init__(self, fn: Callable[..., torch.Tensor], what: str, fallback: str, distinct_sizes: bool = False):
        self.fn = fn
        self.distinct_sizes = distinct_sizes
        self.what, self.fallback = what, fallback  # for the log: "routed experts", "run expert by expert"
        self._compiled: dict[tuple, Callable[..., torch.Tensor]] = {}
        self.failed: str | None = None
        self._per_thread_count: bool | None = None  # each thread count its own compilation (set on the first call)

    def __call__(self, *args) -> torch.Tensor | None:
        if self.failed is not None:
            return None
        try:
            if self._per_thread_count is None:
                self._per_thread_count = not kernels_read_threads_at_run_time()
            key = (args[0].dtype, torch.get_num_threads()) if self._per_thread_count else (args[0].dtype,)
            compiled = self._compiled.get(key)
            if compiled is None:
                return self._compile_and_call(key, args)
            if self.distinct_sizes:  # (torch compiles anew for a layout it has not met: keep them apart then too)
                with _sizes_kept_apart(True):
                    return compiled(*args)
            return compiled(*args)
        except Exception as exc:  # noqa: BLE001 - no compiler, an unsupported op: the caller's path instead
            self.failed = f"{type(exc).__name__}: {_first_line(exc)}"
            log.warning("%s on the CPU %s: compiling their kernel failed (%s)", self.what, self.fallback, self.failed)
            return None

    def _compile_and_call(self, key: tuple, args) -> torch.Tensor:
        """Compile a fresh copy of ``fn`` for ``key`` and call it (torch compiles on the first call),
        under :func:`compile_settings`; once more with probed instruction sets if the trusted one failed,
        and once more with inductor's own binding if the one that leaves the GIL failed."""
        keep_compiled_in_user_cache()
        kernels_release_gil()
        kernels_read_threads_at_run_time()
        suspect_binding = False  # whether inductor's own binding is being tried after the releasing one failed
        while True:
            fresh = types.FunctionType(self.fn.__code__.replace(), self.fn.__globals__, self.fn.__name__,
                                       self.fn.__defaults__, self.fn.__closure__)
            compiled = self._compiled[key] = torch.compile(fresh, dynamic=True)
            settings, trusted = compile_settings()
            try:
                with settings, _sizes_kept_apart(self.distinct_sizes):
                    result = compiled(*args)
            except Exception as exc:  # noqa: BLE001 - re-raised unless the instruction set or binding is to blame
                self._compiled.pop(key, None)
                if trusted:
                    log.info("%s: compiling with the instruction set the CPU's flags name failed (%s); probing "
                             "the instruction sets instead", self.what, _first_line(exc))
                    _distrust_isa_flags()
                elif not suspect_binding and _restore_binding():
                    suspect_binding = True
                else:
                    if suspect_binding:  # it failed with inductor's binding too: the binding was not the cause
                        kernels_release_gil(again=True)
                    raise
            else:
                if suspect_binding:
                    log.warning("%s: compiling failed with the binding that leaves the GIL and worked with "
                                "inductor's; compiled CPU kernels keep the GIL from now on", self.what)
                return result


@contextlib.contextmanager
def _sizes_kept_apart(wanted: bool):
    """Within (where ``wanted``): torch assumes no equality between sizes that happen to be equal.
    The setting is the process's (a compilation on another thread meanwhile sees it too, which
    only makes its shapes more general); set and restored directly, 4 us against 15 for torch's
    config patch, as it wraps every call."""
    if not wanted:
        yield
        return
    from torch.fx.experimental import _config as fx_config

    before = fx_config.use_duck_shape
    fx_config.use_duck_shape = False
    try:
        yield
    finally:
        fx_config.use_duck_shape = before


def _first_line(exc: Exception) -> str:
    return str(exc).splitlines()[0] if str(exc) else ""
