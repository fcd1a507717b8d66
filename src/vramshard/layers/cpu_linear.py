"""Few-token projections on the CPU in half precision: the fastest ATen path per shape, measured in place.

For one to a few tokens (decode), ``F.linear`` in bf16/fp16 on the CPU takes different oneDNN /
ATen paths by shape, and some are far from the memory bound: on the GPU machine's 16-core Xeon
a bf16 ``[1, 14336] x [14336 -> 4096]`` projection ran at 43 GB/s, slower than at 16 tokens,
while ``[1, 4096] x [4096 -> 14336]`` ran at 71 GB/s; on this project's 2-core CI machine
``torch.mv`` did the first shape 3x faster than ``F.linear``. Which path wins depends on the CPU,
the dtype, the shape and the thread count, so :func:`cpu_linear` chooses per (dtype, tokens,
out, in, threads, bias) and keeps the winner for the process.

The choice is measured on the model's own calls: the first ``2 * TRIALS`` calls of a shape take
the candidates in turn, timed, and the median decides. Those calls read each layer's weights
from memory as every later call will; timing one weight over and over instead (the first way
this was done) reads it from the last-level cache, which holds a whole projection on a server
CPU (300 MiB on the GPU machine) and can rank the paths the other way round.

The candidates compute the same product (accumulation order may differ, within the dtype's
rounding). float32 and the GPU always use ``F.linear``. ``VRAMSHARD_CPU_LINEAR=linear`` turns the
choice off (every call ``F.linear``), e.g. to measure what it brings.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

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


KERNELS: dict[str, Kernel] = {"linear": _linear, "mv": _mv, "weight_mm": _weight_mm}
_choice: dict[tuple, str] = {}
_trials: dict[tuple, dict[str, list[float]]] = {}  # shape key -> candidate -> seconds of its timed calls


def enabled() -> bool:
    return os.environ.get("VRAMSHARD_CPU_LINEAR", "auto").lower() != "linear"


def eligible(x: torch.Tensor, w: torch.Tensor) -> bool:
    """A CPU half-precision projection of a few tokens (where the path choice matters)."""
    return (x.device.type == "cpu" and x.dtype in TUNED_DTYPES and w.dtype == x.dtype and x.dim() == 2
            and w.dim() == 2 and 1 <= x.shape[0] <= MAX_TOKENS and not x.requires_grad and enabled())


def cpu_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x[M, K] @ w[N, K].T (+ bias)`` on the CPU by the path measured fastest for this shape."""
    if not eligible(x, w):
        return F.linear(x, w, bias)
    key = (x.dtype, x.shape[0], w.shape[0], w.shape[1], torch.get_num_threads(), bias is not None)
    name = _choice.get(key)
    if name is None:
        return _trial(key, x, w, bias)
    return KERNELS[name](x, w, bias)


def chosen() -> dict[tuple, str]:
    """The choices made so far: (dtype, tokens, out, in, threads, bias) -> kernel name."""
    return dict(_choice)


def forget() -> None:
    """Drop every choice and every trial under way (the next calls of each shape measure again)."""
    _choice.clear()
    _trials.clear()


def _trial(key: tuple, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """This call by the candidate whose turn it is, timed; the choice once each has ``TRIALS`` runs."""
    times = _trials.setdefault(key, {"linear": [], "mv" if x.shape[0] == 1 else "weight_mm": []})
    name = min(times, key=lambda n: len(times[n]))  # in turn, so a burst of outside load hits both
    start = time.perf_counter()
    y = KERNELS[name](x, w, bias)
    times[name].append(time.perf_counter() - start)
    if all(len(t) >= TRIALS for t in times.values()) and _trials.pop(key, None) is not None:
        _choice[key] = _decide(key, times)  # (once: threads calling the same shape may finish together)
    return y


def _decide(key: tuple, times: dict[str, list[float]]) -> str:
    median = {name: statistics.median(t) for name, t in times.items()}
    other = next(name for name in times if name != "linear")
    winner = other if median[other] < MARGIN * median["linear"] else "linear"
    log.debug("CPU projection %s: %s (median linear %.3f ms, %s %.3f ms)", key, winner, median["linear"] * 1e3,
              other, median[other] * 1e3)
    return winner
