"""A few tokens' routed experts on the CPU in one compiled pass over the layer's stacked experts.

A decode step with its experts in host memory (``experts-cpu``, the CPU's share of a host-expert
layer, an engine without a GPU) computes each routed expert as a SwiGLU of one to a few rows. Per
expert that is a gate/up and a down projection of a handful of MiB, plus the activation: small
matrix-vector products whose ATen paths run far from the memory bus (the H200 machine's 16-core
Xeon, fourteenth session: a Qwen3-30B-A3B layer's 8 experts of one token in 5.15 ms, 14.7 GB/s,
against 1.09 ms to read them; 2.35 ms from oneDNN-prepacked weights).

Here every assignment (token, expert) of the step takes its rows of two reductions that inductor
compiles into parallel C++ loops, reading each assigned expert where it lies in the layer's
stacked weights (``gate_up`` [E, 2F, D], ``down`` [E, D, F]; no gather copy). Each loop runs over
the rows of all the assignments at once (A·2F, then A·D). Written as a reduction per (assignment,
row), inductor ran in parallel over the assignments alone wherever it compiled for sizes or threads
that made that look enough: its parallel depth is chosen from the compile-time sizes and thread
count, and the compiled code serves later calls (and, with the thread count read at run time, later
processes through its on-disk cache) of any size and team. A Qwen3-30B-A3B token's 8 experts then
kept 8 threads busy, a share of 3 kept 3, and the rest of the team waited (found in session 28:
compiled at 16 threads from a tiny model's sizes, the loops ran over the experts only). On this project's
2-core development machine (``benchmarks/cpu_experts``) that is 2-3x the per-expert path. An
expert shared by several tokens is read once per assignment, so it pays off up to ``ROWS`` tokens
(at 64 rows the grouped path, each expert once, is faster).

Accumulation is in float32, rounded to the activation dtype once at the end (the per-expert path
rounds after each projection). Half precision only (``DTYPES``): float32 tiny models keep the
per-expert path. Compiling needs a C++ compiler; without one (or
on any compile error) the first call says so in the log and every call returns None, for the
caller's own path (:mod:`~vramshard.layers.cpu_compiled`). Where the compiled kernels keep the GIL
(:func:`~vramshard.layers.cpu_compiled.kernels_release_gil` could not change their binding) it does
not run on a thread that keeps the GIL free (the run-ahead worker). ``VRAMSHARD_HOST_EXPERTS=off``
turns this off.

Where the C kernel builds, the whole step is one call of it instead
(:func:`~vramshard.layers.cpu_gemv.routed_experts`: the assignments grouped by expert, each routed
expert read once for all its tokens, the activation rounded once to the dtype, nothing compiled,
the GIL left free for the whole call), a share of the assignments too (``keep``: the CPU's share
beside the GPU's zero-copy kernels, on the run-ahead worker), reading only their experts. Elsewhere
one token is one compiled call, glue and weighted sum included, and more tokens, or a share, the
several-token pass. On the 2-core development machine (host read 32 GB/s) a Qwen3-30B-A3B layer's
routed experts took 3.20 ms in the C kernel against 4.42 ms compiled and 2.36 ms to read at one
token, 12.4 against 16.3 (8.6 to read) at 4 tokens and 39.2 against 71.2 (23.3) at 16
(``python -m benchmarks.cpu_experts``, session 35; docs/BENCHMARKS.md).

Each torch call gives the GIL up and takes it back, and on the run-ahead worker, beside the host
thread running Python, every take waits for the switch interval: the several-token pass's dozen
calls around its kernel waited 23-24 intervals a pass there, the compiled one-token call 2-6 (the
2-core development machine, session 25, ``python -m benchmarks.compiled_gil``, three runs), and the
pass on the worker took 3.20-3.43 ms against 2.81-3.01 alone (6.2-6.8 against 3.0-3.4 in session 24).
The C kernel's pass takes the GIL back twice (its output's allocation and its call): on the
development machine beside Python, 1.0-2.0 intervals a pass at 50 ms against 3.0 for the compiled
one-token call and 27.2 for the several-token pass of a share (``compiled_gil``, session 35).
"""

from __future__ import annotations

import threading
import time

import torch
import torch.nn.functional as F

from ..env import switch
from . import cpu_compiled, cpu_gemv
from .cpu_compiled import CompiledKernel

ENABLED = switch("VRAMSHARD_HOST_EXPERTS", default=True)
ROWS = 16  # the most tokens of a step computed this way
DTYPES = (torch.bfloat16, torch.float16)


def _assigned_swiglu(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                     experts: torch.Tensor) -> torch.Tensor:
    """``down_e(silu(gate_e(h_a)) * up_e(h_a))`` for each assignment a to expert e, in float32.

    h: [A, D] float32, each assignment's hidden state; gate_up: [E, 2F, D]; down: [E, D, F];
    experts: [A] int64. Returns [A, D] float32.

    Each product is one reduction over the rows of every assignment's weight (A·2F rows, then A·D),
    so the compiled loop that runs in parallel is over those rows, whatever the sizes and thread
    count it was compiled for (see the module's notes). Its inner loop divides to find each row's
    expert: where the assignments alone share out evenly over the threads,
    :func:`_assigned_swiglu_by_assignment` is faster (on the development machine, 2 threads: 1.74
    against 2.17 ms for a token's 8 experts, 24.65 against 27.14 ms for 16 tokens;
    ``python -m benchmarks.cpu_layouts``)."""
    assigned, both_rows, hidden = experts.shape[0], gate_up.shape[1], gate_up.shape[2]
    rows = torch.arange(both_rows, device=experts.device).repeat(assigned)  # [A·2F]
    both = (gate_up[experts.repeat_interleave(both_rows), rows].float()
            * h.repeat_interleave(both_rows, dim=0)).sum(-1).view(assigned, both_rows)  # [A, 2F]
    gate, up = both.chunk(2, dim=-1)  # [A, F] each
    act = F.silu(gate) * up
    rows = torch.arange(hidden, device=experts.device).repeat(assigned)  # [A·D]
    return (down[experts.repeat_interleave(hidden), rows].float()
            * act.repeat_interleave(hidden, dim=0)).sum(-1).view(assigned, hidden)  # [A, D]


def _assigned_swiglu_by_assignment(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                                   experts: torch.Tensor) -> torch.Tensor:
    """:func:`_assigned_swiglu` as a reduction per (assignment, row): the compiled loop that runs in
    parallel may be over the assignments alone (see the module's notes)."""
    both = (gate_up[experts].float() * h[:, None, :]).sum(-1)  # [A, 2F]
    gate, up = both.chunk(2, dim=-1)  # [A, F] each
    act = F.silu(gate) * up
    return (down[experts].float() * act[:, None, :]).sum(-1)  # [A, D]


def _one_token(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, experts: torch.Tensor,
               weights: torch.Tensor) -> torch.Tensor:
    """One token's weighted sum over its routed experts, the whole of :func:`routed` in one compiled
    function. x: [1, D] float32; experts, weights: [1, k]. Returns [1, D] in the experts' dtype."""
    k = experts.shape[1]
    y = _assigned_swiglu(x.expand(k, -1), gate_up, down, experts[0])  # [k, D]
    return (y * weights[0].float()[:, None]).sum(0, keepdim=True).to(gate_up.dtype)


def _one_token_by_assignment(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, experts: torch.Tensor,
                             weights: torch.Tensor) -> torch.Tensor:
    """:func:`_one_token` over :func:`_assigned_swiglu_by_assignment`."""
    y = _assigned_swiglu_by_assignment(x, gate_up, down, experts[0])  # [k, D]
    return (y * weights[0].float()[:, None]).sum(0, keepdim=True).to(gate_up.dtype)


# (the row-parallel form, and the form by assignment, which computes as fast where the assignments
# alone share out evenly over the threads: by_assignment)
_kernel = CompiledKernel(_assigned_swiglu, "routed experts", "run expert by expert")
_kernel_by_assignment = CompiledKernel(_assigned_swiglu_by_assignment, "routed experts", "run expert by expert")
_one_token_kernel = CompiledKernel(_one_token, "a token's routed experts", "run them through the several-token pass")
_one_token_kernel_by_assignment = CompiledKernel(_one_token_by_assignment, "a token's routed experts",
                                                 "run them through the several-token pass")
EVEN_SHARE = 1.1  # assignments share out evenly: the busiest thread has at most this much the mean


def by_assignment(assignments: int, threads: int | None = None) -> bool:
    """Whether a pass of ``assignments`` on ``threads`` (default: this thread's count) takes the form by
    assignment: a static share of the assignments alone leaves the busiest thread at most
    :data:`EVEN_SHARE` times the mean (else the row-parallel form, which shares out every row)."""
    threads = threads or torch.get_num_threads()
    return assignments >= threads and -(-assignments // threads) * threads <= EVEN_SHARE * assignments


_timing = threading.local()  # .seconds: this thread's time in the one-token compiled call


def kernel_seconds() -> float:
    """Seconds this thread has spent so far in the pass's one call (the C kernel's, or the compiled
    one-token one; the rest of a CPU part — its glue, its copies — is the caller's time less this)."""
    return getattr(_timing, "seconds", 0.0)


def eligible(h: torch.Tensor, gate_up: torch.Tensor) -> bool:
    """Whether a step of ``h`` [T, D] over experts ``gate_up`` [E, 2F, D] is computed here."""
    return (ENABLED and h.device.type == "cpu" and gate_up.device.type == "cpu" and h.dtype in DTYPES
            and gate_up.dtype == h.dtype and 1 <= h.shape[0] <= ROWS and not h.requires_grad
            and _kernel.failed is None and _kernel_by_assignment.failed is None and cpu_compiled.allowed())


def routed(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, experts: torch.Tensor,
           weights: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor | None:
    """The weighted sum over each token's routed experts, [T, D] in ``h``'s dtype; None where the
    kernel cannot run here (the caller computes it its own way).

    h: [T, D]; gate_up: [E, 2F, D] and down: [E, D, F] (strided views over the host buffer);
    experts, weights: [T, k] (token-major); keep: [T, k] bool, the assignments to compute (the
    others count zero), or None for all."""
    if ENABLED and cpu_gemv.serves_experts(h, gate_up, down, experts, weights, keep):  # one C call
        began = time.perf_counter()
        y = cpu_gemv.routed_experts(h, gate_up, down, experts, weights, keep)
        _timing.seconds = kernel_seconds() + time.perf_counter() - began
        return y
    if not eligible(h, gate_up):
        return None
    if keep is None and h.shape[0] == 1:  # a decode step: one compiled call (see the module's notes)
        x = h.float()
        began = time.perf_counter()
        kernel = _one_token_kernel_by_assignment if by_assignment(experts.shape[1]) else _one_token_kernel
        y = kernel(x, gate_up, down, experts, weights)
        _timing.seconds = kernel_seconds() + time.perf_counter() - began
        if y is not None:
            return y
    T, k = experts.shape
    tokens = torch.arange(T).repeat_interleave(k)  # [A], token-major as experts.reshape(-1)
    flat, scale = experts.reshape(-1), weights.reshape(-1).float()
    if keep is not None:
        chosen = keep.reshape(-1).nonzero().squeeze(-1)
        tokens, flat, scale = tokens[chosen], flat[chosen], scale[chosen]
    out = torch.zeros(T, h.shape[-1], dtype=torch.float32)
    if flat.numel():
        kernel = _kernel_by_assignment if by_assignment(flat.numel()) else _kernel
        y = kernel(h.float().index_select(0, tokens), gate_up, down, flat)  # [A, D]
        if y is None:
            return None
        out.index_add_(0, tokens, y.mul_(scale[:, None]))
    return out.to(h.dtype)


def routed_part(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, experts: torch.Tensor,
                weights: torch.Tensor, out: torch.Tensor) -> cpu_gemv.BoundPart | None:
    """:func:`routed` of every assignment, written into ``out``, as one C call bound ahead of its inputs'
    values (:func:`~vramshard.layers.cpu_gemv.bind_routed_experts_part`: the run-ahead worker's part, the
    GIL free from its wait for the inputs to its ticket); None where :func:`routed` would not take the C
    kernel here."""
    return cpu_gemv.bind_routed_experts_part(h, gate_up, down, experts, weights, out) if ENABLED else None


def warm_up(gate_up: torch.Tensor, down: torch.Tensor) -> None:
    """Compile the pass, in both its forms, for these stacked experts' dtype and layout now (seconds
    the first time: 4-6 s a form on the 2-core development machine), not in the first step that needs
    it; quick once compiled. Nothing where the C kernel computes them."""
    if gate_up.shape[0] < 2 or not eligible(torch.zeros(1, gate_up.shape[-1], dtype=gate_up.dtype), gate_up):
        return
    with torch.inference_mode():
        x = torch.zeros(1, gate_up.shape[-1])
        experts, weights = torch.tensor([[0, 1]]), torch.zeros(1, 2, dtype=gate_up.dtype)
        if cpu_gemv.serves_experts(x.to(gate_up.dtype), gate_up, down):
            return  # the C kernel's: nothing to compile
        for one_token in (_one_token_kernel, _one_token_kernel_by_assignment):  # a decode step: one call
            one_token(x, gate_up, down, experts, weights)
        for several in (_kernel, _kernel_by_assignment):  # more tokens (and a share of a token's experts)
            several(x.expand(2, -1).contiguous(), gate_up, down, experts[0])
