"""Few-token projections on the CPU in half precision: the fastest path per shape, measured in place.

For one to a few tokens (decode), ``F.linear`` in bf16/fp16 on the CPU takes different oneDNN /
ATen paths by shape, and some are far from the memory bound: on the GPU machine's 16-core Xeon
a bf16 ``[1, 14336] x [14336 -> 4096]`` projection ran at 43 GB/s, slower than at 16 tokens,
while ``[1, 4096] x [4096 -> 14336]`` ran at 71 GB/s; on this project's 2-core CI machine
``torch.mv`` did the first shape 3x faster than ``F.linear``. Which path wins depends on the CPU,
the dtype, the shape and the thread count, so :func:`cpu_linear` chooses per (dtype, tokens,
out, in, threads, bias, candidates) and keeps the winner for the process.

For one token over a weight whose rows are contiguous (a whole weight, or the column slice of a
split FFN's CPU part: ``down[:, a:b]``) a third candidate is the product as row sums compiled by
inductor (:mod:`.cpu_compiled`): with it, llama3-8b's CPU decode on the 2-core AMD EPYC
development machine went from 5.2-5.4 to 10.0-11.6 tok/s (docs/BENCHMARKS.md, "Changed after the
fourteenth session"). It is compiled before its first timed trial (and
at engine load, :func:`warm_up`), and not offered on threads that keep the GIL free (the run-ahead
worker; inductor's kernels hold it). At more tokens it reads the weight once per token, slower.

The choice is measured on the model's own calls: the first ``2 * TRIALS`` calls of a shape take
the candidates in turn, timed, and the median decides. Those calls read each layer's weights
from memory as every later call will; timing one weight over and over instead (the first way
this was done) reads it from the last-level cache, which holds a whole projection on a server
CPU (300 MiB on the GPU machine) and can rank the paths the other way round.

The candidates compute the same product (accumulation order may differ, within the dtype's
rounding). float32 and the GPU always use ``F.linear``. ``VRAMSHARD_CPU_LINEAR=linear`` turns the
choice off (every call ``F.linear``), ``=aten`` leaves the compiled candidate out, e.g. to measure
what each brings.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from . import cpu_compiled, cpu_gemv
from .cpu_compiled import CompiledKernel

log = logging.getLogger(__name__)

MAX_TOKENS = 16  # rows of x up to which the choice is made; above, F.linear (a real GEMM) is right
TUNED_DTYPES = (torch.bfloat16, torch.float16)
MARGIN = 0.9  # another path must be at least 10% faster than F.linear to be chosen (noise)
TRIALS = 5  # real calls timed per candidate before the choice

Kernel = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def _linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, w, bias)


def _mv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One token: ``W[N, K] @ x[K]`` as a matrix-vector product."""
    y = torch.mv(w, x[0]).unsqueeze(0)  # [1, N]
    return y if bias is None else y + bias


def _weight_mm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A few tokens: ``(W[N, K] @ x.T[K, M]).T`` — the weight as the left operand."""
    y = torch.mm(w, x.t()).t().contiguous()  # [M, N]
    return y if bias is None else y + bias


def _row_sums(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x[1, K] @ w[N, K].T`` as a multiply-and-sum over W's rows, float32 accumulation → [1, N]."""
    return (w.float() * x.float()).sum(-1)[None].to(x.dtype)


_GEMV = CompiledKernel(_row_sums, "one-token projections", "run through ATen")
# Column slices (split FFN parts' down projections) in a code copy of their own: each layout and
# size range is a compilation, and one copy holds at most 8 before torch runs it eagerly.
_GEMV_SLICED = CompiledKernel(_row_sums, "one-token projections over column slices", "run through ATen")


def _compiled(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One token, ``W[N, K]`` with contiguous rows: the row sums compiled by inductor (:mod:`.cpu_compiled`)."""
    y = (_GEMV if w.is_contiguous() else _GEMV_SLICED)(x, w)
    if y is None:  # compiling failed (said once in the log): this call through ATen
        y = F.linear(x, w)
    return y if bias is None else y + bias


def _gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One token by the C kernel (:mod:`.cpu_gemv`), float32 sums rounded to ``x``'s dtype."""
    y = cpu_gemv.rows_times_weight(x, w).to(x.dtype)
    return y if bias is None else y + bias


KERNELS: dict[str, Kernel] = {"linear": _linear, "mv": _mv, "weight_mm": _weight_mm, "compiled": _compiled,
                              "gemv": _gemv}
COMPILED = True  # whether one-token projections may take the compiled row sums (tests turn it off)
_choice: dict[tuple, str] = {}
_trials: dict[tuple, dict[str, list[float]]] = {}  # shape key -> candidate -> seconds of its timed calls
_warmed: set[tuple] = set()  # (dtype, threads) the row sums are compiled for
# Every chooser's trials under way (this module's, and those of choosers built on these projections,
# :mod:`.cpu_swiglu`): :func:`settle` runs a call until it adds to none of them.
TRIAL_BOOKS: list[dict[tuple, dict[str, list[float]]]] = [_trials]
_trial_calls = 0  # calls made as a candidate's trial, by any chooser (trial_calls)


def enabled() -> bool:
    return os.environ.get("VRAMSHARD_CPU_LINEAR", "auto").strip().lower() != "linear"


def compiled_allowed() -> bool:
    """Whether the compiled row sums may compete here (``VRAMSHARD_CPU_LINEAR=aten``: ATen's paths only)."""
    return COMPILED and os.environ.get("VRAMSHARD_CPU_LINEAR", "auto").strip().lower() != "aten" \
        and _GEMV.failed is None and cpu_compiled.allowed()


def eligible(x: torch.Tensor, w: torch.Tensor) -> bool:
    """A CPU half-precision projection of a few tokens (where the path choice matters)."""
    return (x.device.type == "cpu" and x.dtype in TUNED_DTYPES and w.dtype == x.dtype and x.dim() == 2
            and w.dim() == 2 and 1 <= x.shape[0] <= MAX_TOKENS and not x.requires_grad and enabled())


def cpu_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x[M, K] @ w[N, K].T (+ bias)`` on the CPU by the path measured fastest for this shape."""
    if not eligible(x, w):
        return F.linear(x, w, bias)
    candidates = _candidates(x, w)
    key = (x.dtype, x.shape[0], w.shape[0], w.shape[1], torch.get_num_threads(), bias is not None, candidates)
    name = _choice.get(key)
    if name is None:
        return _trial(key, candidates, x, w, bias)
    return KERNELS[name](x, w, bias)


def settle(call: Callable[[], object], max_calls: int = 64) -> None:
    """Run ``call`` (a benchmark's timed call: projections over cold weights, a whole FFN) until
    none of the projections it makes is still on trial, so that what is timed next is the chosen
    paths, not the candidates' trials and the compilation. Timed without it, a process's first
    bf16 [1, 4096] x [4096 -> 14336] took 6.9-8.7 ms against 1.6 ms later on the H200 machine's
    host (the profile check's first probe, seventeenth GPU session), 32 ms against 6.3-6.6 on the
    2-core development machine: a call that compiles outlasts the timing budget, and the time
    became that of the trials around it. Trials of shapes that ``call`` does not make are left be."""
    def counts() -> dict[tuple, int]:
        return {(book_index, key): sum(map(len, times.values()))
                for book_index, book in enumerate(TRIAL_BOOKS) for key, times in book.items()}

    for _ in range(max_calls):
        made = counts()
        call()
        if all(count == made.get(key) for key, count in counts().items()):
            return  # no trial was added to by this call: its paths are chosen


def decided(dtype: torch.dtype, rows: int, w: torch.Tensor) -> bool:
    """Whether a projection of ``rows`` rows of ``dtype`` over ``w`` (no bias) runs a chosen path
    here: one made already, or none to make (not :func:`eligible`)."""
    x = torch.empty(rows, w.shape[1], dtype=dtype)
    if not eligible(x, w):
        return True
    return (dtype, rows, w.shape[0], w.shape[1], torch.get_num_threads(), False, _candidates(x, w)) in _choice


def _candidates(x: torch.Tensor, w: torch.Tensor) -> tuple[str, ...]:
    """The paths that may compute this projection here: the compiled row sums for one token over
    a weight whose rows are contiguous, on threads that may hold the GIL (:func:`.cpu_compiled.allowed`).

    A column slice counts (a split FFN part's ``down[:, a:b]``): the split parts' CPU work ran
    1.3-1.6x its prediction on the H200 machine (docs/BENCHMARKS.md, fifteenth session), and the
    profile times whole weights, which the compiled row sums alone served. Whether the slices'
    kernels close that gap has not been measured on that machine yet."""
    if x.shape[0] > 1:
        # (Not the C kernel: its sums round differently from these two, so a prompt's first calls, which
        # take the candidates in turn, would give other tokens than later ones where logits nearly tie.)
        return ("linear", "weight_mm")
    if cpu_gemv.serves(x, w):  # (in its place the compiled row sums, which cost a compile at load)
        return ("linear", "mv", "gemv")
    if w.stride(-1) == 1 and compiled_allowed():
        return ("linear", "mv", "compiled")
    return ("linear", "mv")


def warm_up(dtype: torch.dtype) -> None:
    """Compile the one-token row sums for ``dtype`` at the process's thread count now (seconds the
    first time), not inside a step; nothing where they do not apply. Each weight layout the
    projections meet is a compilation of its own: a whole weight, and column slices at the start
    of a weight and inside it (split FFN parts), whatever their sizes (shapes are symbolic)."""
    key = (dtype, torch.get_num_threads())
    if not (enabled() and compiled_allowed() and dtype in TUNED_DTYPES) or key in _warmed or gemv_serves(dtype):
        return
    # As in a step: weights made outside inference mode, activations inside it (torch compiles
    # anew for another kind of tensor, and for K above and below 4096).
    weight = torch.zeros(48, 8192, dtype=dtype)
    narrow = weight[:, :2048].contiguous()
    with torch.inference_mode():
        for kernel, w in ((_GEMV, weight), (_GEMV, narrow), (_GEMV_SLICED, weight[:, :4160]),
                          (_GEMV_SLICED, weight[:, :2048]), (_GEMV_SLICED, weight[:, 4160:]),
                          (_GEMV_SLICED, weight[:, 2048:])):
            kernel(torch.zeros(1, w.shape[1], dtype=dtype), w)
    _warmed.add(key)


def gemv_serves(dtype: torch.dtype) -> bool:
    """Whether one-token projections of ``dtype`` take the C kernel here instead of the compiled row
    sums (then nothing is compiled for them)."""
    return cpu_gemv.serves(torch.zeros(1, 8, dtype=dtype), torch.zeros(8, 8, dtype=dtype))


def trial_calls() -> int:
    """How many calls so far ran as a candidate's trial, by this module's chooser or one built on it
    (:mod:`.cpu_swiglu`). A step that made one ran paths it will not run again: while llama3-8b's
    head chose its path on the H100 machine, the first decode steps' CPU work took 1.8x the head's
    prediction, and the engine fitted that to every CPU layer (docs/BENCHMARKS.md, thirty-fifth
    GPU session)."""
    return _trial_calls


def count_trial() -> None:
    """Count one call made as a candidate's trial (:func:`trial_calls`)."""
    global _trial_calls
    _trial_calls += 1


def chosen() -> dict[tuple, str]:
    """The choices made so far: (dtype, tokens, out, in, threads, bias, candidates) -> kernel name."""
    return dict(_choice)


def forget() -> None:
    """Drop every choice and every trial under way (the next calls of each shape measure again)."""
    _choice.clear()
    _trials.clear()


def _trial(key: tuple, candidates: tuple[str, ...], x: torch.Tensor, w: torch.Tensor,
           bias: torch.Tensor | None) -> torch.Tensor:
    """This call by the candidate whose turn it is, timed; the choice once each has ``TRIALS`` runs."""
    times = _trials.setdefault(key, {name: [] for name in candidates})
    name = min(times, key=lambda n: len(times[n]))  # in turn, so a burst of outside load hits all
    count_trial()
    if name == "compiled":
        warm_up(x.dtype)  # (its compile is not a trial's time)
    start = time.perf_counter()
    y = KERNELS[name](x, w, bias)
    times[name].append(time.perf_counter() - start)
    if all(len(t) >= TRIALS for t in times.values()) and _trials.pop(key, None) is not None:
        _choice[key] = _decide(key, times)  # (once: threads calling the same shape may finish together)
    return y


def _decide(key: tuple, times: dict[str, list[float]]) -> str:
    median = {name: statistics.median(t) for name, t in times.items()}
    fastest = min(median, key=median.get)
    winner = fastest if median[fastest] < MARGIN * median["linear"] else "linear"
    log.debug("CPU projection %s: %s (median ms: %s)", key[:6], winner,
              ", ".join(f"{name} {t * 1e3:.3f}" for name, t in median.items()))
    return winner
