"""A CPU SwiGLU of a few rows as one compiled function, where measured faster than its projections.

A dense FFN's CPU work at decode (a split FFN's CPU part, a whole FFN on the CPU) is, done
projection by projection, five or more torch calls: the gate and up projections (each through the
path :mod:`~vramshard.layers.cpu_linear` chose for its shape), SiLU, the product and the down
projection. Here the whole SwiGLU is one function compiled by inductor: for one token the gate and
up products are row sums in one loop nest over both weights (float32 accumulation), then the down
projection, as row sums too where down's rows are contiguous (since session 28: on the development
machine a llama3-8b quarter part's down took 0.77 ms as row sums against 1.87 ms through ATen, its
weights' read time being 0.55 ms, ``python -m benchmarks.cpu_layouts``); for more rows, three matrix products through ATen with the SiLU·up product fused
between them. Every view and product is inside the function: each torch call made from Python
gives the GIL up and takes it back, and beside a thread running Python each take waits for the
switch interval. On the 2-core development machine (session 25, ``python -m benchmarks.cpu_swiglu``,
bf16, weights as the engine packs them, cycled beyond the cache), at one token, it was 4-31%
faster alone for four FFN parts of five (12.16 against 16.90 ms for llama3-8b's whole FFN) and 5%
slower for the fifth, and 8-23% faster on a worker beside a thread running Python for four and
level for the fifth; at 4 to 64 rows mostly within 4%, but 22-27% slower alone for three parts at
16 rows. It waited for the GIL 3-9 times a call beside that thread against the projections' 5-17.
Hence the choice in place.

Which way a part runs is measured in place, as :mod:`~vramshard.layers.cpu_linear` chooses a
projection's path: the first calls of a part's shape time both ways, ``TRIALS`` each, and the
median decides (the compiled function must be ``MARGIN`` faster). The projections' own path
choices are made first: until then their calls do not count. The shape's key holds the thread
count and whether the calling thread shares the GIL with a host thread that runs Python meanwhile
(the run-ahead worker: :func:`~vramshard.layers.cpu_compiled.gil_kept_free`), so the worker's
choice is made beside the host's Python.

Where the C kernel takes dense FFN work (:mod:`.cpu_gemv`, beside a GPU by default) none of this runs:
the kernel computes up to four rows, the projections more (:func:`kernel_takes_ffns`).

Half precision, 1 to ``MAX_ROWS`` rows. Compiling needs a C++ compiler (the first failure is said
once in the log; the projections then serve every call). ``VRAMSHARD_CPU_SWIGLU=off`` turns it
off.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from ..env import switch
from . import cpu_compiled, cpu_gemv, cpu_linear
from .cpu_compiled import CompiledKernel

log = logging.getLogger(__name__)

ENABLED = switch("VRAMSHARD_CPU_SWIGLU", default=True)
COMPILED = True  # whether parts may take the compiled call (tests turn it off)
MAX_ROWS = 64  # decode batches; prompt chunks are matrix products, where torch's own calls are right
DTYPES = (torch.bfloat16, torch.float16)
TRIALS = 5  # real calls timed per way before the choice
MARGIN = 0.95  # the compiled function must take at most this share of the projections' median
WAYS = ("projections", "compiled")


# (Every view and product is inside the compiled function: each torch call made from Python, a
# transpose too, gives the GIL up and takes it back, which beside a thread running Python waits for
# the switch interval; with down's transpose outside a call took it back 7 times here, 5 inside.)
def _one_token(h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """SwiGLU of one token: h [1, D]; gate, up [r, D]; down [D, r] → [1, D]. The gate and up products
    are row sums over the weights' rows, in float32. So is the down product where down's rows are
    contiguous (a whole FFN packed plainly, or a copy of a part's); a down stored transposed (a
    splittable FFN's, [r, D] in memory) goes through ATen's product, which reads it row by row (row
    sums would walk its columns)."""
    x = h.float()
    gated = F.silu((gate.float() * x).sum(-1)) * (up.float() * x).sum(-1)  # [r]
    if down.stride(-1) == 1:
        return (down.float() * gated).sum(-1)[None].to(h.dtype)
    return torch.mm(gated.to(h.dtype)[None], down.t())


def _rows(h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """SwiGLU of h [T, D] (T > 1) with the same weights → [T, D]."""
    return torch.mm(F.silu(torch.mm(h, gate.t())) * torch.mm(h, up.t()), down.t())


_ONE_TOKEN = CompiledKernel(_one_token, "one-token SwiGLU parts", "run projection by projection", distinct_sizes=True)
_ROWS = CompiledKernel(_rows, "few-row SwiGLU parts", "run projection by projection", distinct_sizes=True)

_choice: dict[tuple, str] = {}
# part key -> way -> seconds of its timed calls (and "untimed": calls of the projections not counted;
# "compiled_once": the compiled function's first call, which compiled it)
_trials: dict[tuple, dict[str, list[float]]] = {}
cpu_linear.TRIAL_BOOKS.append(_trials)  # (cpu_linear.settle waits for these too)
_warmed: set[tuple] = set()  # (dtype, threads) both kernels are compiled for


def compiled(h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor | None:
    """``down(silu(gate(h)) * up(h))`` as one compiled call (down: [D, r], Hugging Face layout);
    None where it cannot run (compiling failed)."""
    kernel = _ONE_TOKEN if h.shape[0] == 1 else _ROWS
    return kernel(h, gate, up, down)


def wanted(h: torch.Tensor) -> bool:
    """Whether a SwiGLU of ``h`` may be worth the choice: a CPU half-precision activation of 1 to
    ``MAX_ROWS`` rows (checked first, and cheaply: every FFN call asks, the GPU's too), where the C
    kernel does not take dense FFN work (:func:`kernel_takes_ffns`)."""
    return ENABLED and COMPILED and h.device.type == "cpu" and h.dtype in DTYPES and h.dim() == 2 \
        and 1 <= h.shape[0] <= MAX_ROWS and not kernel_takes_ffns()


def kernel_takes_ffns() -> bool:
    """Whether the C kernel computes dense FFN work of a few rows here (:func:`.cpu_gemv.computes`;
    beside a GPU by default): then the compiled function serves no rows. Up to ``cpu_gemv.FFN_ROWS``
    rows the kernel does, above them the projections: on the H100 machine compiling this function for
    5 to 16 rows took 21.7 s of llama3-8b's 32.6 s load at 8 GiB (the thirty-second GPU session,
    docs/BENCHMARKS.md), where at 64 rows it had been 16% faster than the projections for one part and
    19% slower for another (twenty-third GPU session), and each new layout of a part's weights (a
    narrower part reading a wider row-major down copy) compiles it anew."""
    return cpu_gemv.computes(1)


def eligible(h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> bool:
    """:func:`wanted`, with weights of ``h``'s dtype and the compiled call allowed here."""
    return (wanted(h) and gate.dtype == up.dtype == down.dtype == h.dtype and not h.requires_grad
            and _kernel_for(h).failed is None and cpu_compiled.allowed())


def swiglu(h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
           projections: Callable[[], torch.Tensor], projected: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """``down(silu(gate(h)) * up(h))`` by the way measured faster for this shape here:
    ``projections()`` (the caller's torch calls, projecting by the weights ``projected``, default
    gate, up and down) or :func:`compiled`."""
    if not eligible(h, gate, up, down):
        return projections()
    key = (h.dtype, h.shape[0], gate.shape[0], h.shape[1], down.stride(), torch.get_num_threads(),
           cpu_compiled.beside_host())
    way = _choice.get(key)
    if way == "projections":
        return projections()
    if way == "compiled":
        y = compiled(h, gate, up, down)
        return projections() if y is None else y
    return _trial(key, h, gate, up, down, projections, (gate, up, down) if projected is None else projected)


def _trial(key: tuple, h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
           projections: Callable[[], torch.Tensor], projected: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """This call by the way whose turn it is, timed; the choice once each has ``TRIALS`` timings.
    The projections' timings count only once their own paths are chosen: until then the compiled
    call takes its trials, then the projections run untimed (their own trials go on)."""
    times = _trials.setdefault(key, {way: [] for way in WAYS})
    cpu_linear.count_trial()
    counted = _projections_chosen(h.dtype, h.shape[0], projected)
    if counted:
        way = min(WAYS, key=lambda n: len(times[n]))
    else:
        way = "compiled" if len(times["compiled"]) < TRIALS else "projections"
    if way == "compiled":
        if not times["compiled"] and not times.get("compiled_once"):  # its first call compiles: not a trial's time
            times["compiled_once"] = [0.0]
            y = compiled(h, gate, up, down)
            return projections() if y is None else y  # (None: failed; the next call records it)
        start = time.perf_counter()
        y = compiled(h, gate, up, down)
        if y is None:  # compiling failed (said once in the log): the projections from now on
            _trials.pop(key, None)
            _choice[key] = "projections"
            return projections()
    else:
        start = time.perf_counter()
        y = projections()
        if not counted:
            times.setdefault("untimed", []).append(0.0)  # (the trial goes on: cpu_linear.settle sees it)
            return y
    times[way].append(time.perf_counter() - start)
    if len(times["projections"]) >= TRIALS and len(times["compiled"]) >= TRIALS \
            and _trials.pop(key, None) is not None:
        _choice[key] = _decide(key, times)  # (once: threads calling the same shape may finish together)
    return y


def _projections_chosen(dtype: torch.dtype, rows: int, projected: tuple[torch.Tensor, ...]) -> bool:
    """Whether the projections by these weights have their paths chosen (no trial of theirs under way)."""
    return all(cpu_linear.decided(dtype, rows, w) for w in projected)


def _decide(key: tuple, times: dict[str, list[float]]) -> str:
    median = {name: statistics.median(times[name]) for name in WAYS}
    winner = "compiled" if median["compiled"] < MARGIN * median["projections"] else "projections"
    log.debug("CPU SwiGLU part %s: %s (median ms: projections %.3f, compiled %.3f)", key[:4], winner,
              median["projections"] * 1e3, median["compiled"] * 1e3)
    return winner


def _kernel_for(h: torch.Tensor) -> CompiledKernel:
    return _ONE_TOKEN if h.shape[0] == 1 else _ROWS


def warm_up(dtype: torch.dtype) -> None:
    """Compile both ways (one token, several rows) for ``dtype`` at this thread count now (seconds
    the first time), not inside a step, for every layout an engine's host weights give them;
    nothing where they do not apply."""
    key = (dtype, torch.get_num_threads())
    if not (ENABLED and COMPILED and dtype in DTYPES and cpu_compiled.allowed()) or key in _warmed \
            or kernel_takes_ffns():
        return
    _warmed.add(key)
    # Torch compiles anew for another view structure or stride pattern: the weights as the engine's
    # host buffers hold them (views into one byte buffer), made outside inference mode, activations
    # inside it. A whole FFN (gate and up apart, or chunks of gate_up) with its down [D, F], and a
    # split part: rows of gate and up, columns of a down stored transposed ([F, D]), or its row-major
    # copy (runtime/cpu_down.py: a tensor of its own, or the leading columns of a wider part's).
    hidden, width = 80, 48
    gate, up, down, gate_up, stored_down = _host_views(dtype, (width, hidden), (width, hidden), (hidden, width),
                                                       (2 * width, hidden), (width, hidden))
    layouts = [(gate, up, down), (*gate_up.chunk(2, dim=0), down), (gate[:24], up[:24], stored_down[:24].t()),
               (gate[:24], up[:24], stored_down[:24].t().contiguous()),
               (gate[:24], up[:24], stored_down[:32].t().contiguous()[:, :24])]  # (a wider copy's columns)
    with torch.inference_mode():
        for rows in (1, 2):
            h = torch.zeros(rows, hidden, dtype=dtype)
            for g, u, d in layouts:
                compiled(h, g, u, d)


def _host_views(dtype: torch.dtype, *shapes: tuple[int, int]) -> list[torch.Tensor]:
    """Zero tensors of ``shapes``, each a view into one flat byte buffer (as host weights are)."""
    sizes = [rows * cols * dtype.itemsize for rows, cols in shapes]
    buffer = torch.zeros(sum(sizes), dtype=torch.uint8)
    views, at = [], 0
    for shape, nbytes in zip(shapes, sizes):
        views.append(buffer[at:at + nbytes].view(dtype).view(shape))
        at += nbytes
    return views


def chosen() -> dict[tuple, str]:
    """The choices made so far: part key -> ``projections`` or ``compiled``."""
    return dict(_choice)


def forget() -> None:
    """Drop every choice and every trial under way."""
    _choice.clear()
    _trials.clear()
