"""A MoE layer's routed experts computed on the GPU straight from pinned host memory (on where
Triton and an Ampere-or-newer GPU are there; ``VRAMSHARD_EXPERTS_ZERO_COPY=off`` turns it off).

A MoE decode step with its experts in host memory (``experts-cpu``, the host-expert layers of a
low-budget plan) sends each layer's hidden states and routing to the host, waits for the router,
computes the experts on the CPU and sends the result back: a host round trip per layer, and the
host thread on the critical path (the MoE issue: 30% of its bound). Here two Triton kernels read
the routed experts' weights where they lie, in pinned host memory, through the GPU's mapping of it
(zero-copy): the routing never leaves the GPU, nothing waits on the host, and the PCIe link is read
at the copy engine's speed (``benchmarks/zero_copy`` on the H200 machine, thirteenth session: a
Triton GEMV over 24–384 MiB of pinned weights at 49–51 GB/s, against 54–55 GB/s for the copy
engine's copy; 36 GB/s over a single 6 MiB expert).

For ``A = T·k`` assignments (token-major, as :class:`~vramshard.layers.moe.Routing` holds them):

- ``_gate_up_act``: program (a, block of F) reads its expert's gate and up rows, [BLOCK_F, D] each,
  and writes ``silu(h_t·gate) · (h_t·up)`` into ``act`` [A, F] (float32);
- ``_down``: program (a, block of D) reads its expert's down rows [BLOCK_D, F] and writes
  ``weight_a · (down · act_a)`` into ``y`` [A, D] (float32); the layer's output is ``y``'s sum over
  each token's k assignments.

With a VRAM expert cache (:class:`CachedSource`), each program looks its expert up in the layer's
slot table on the GPU and reads the cache's slot where the expert is cached, host memory where it
is not: a cached layer's decode step then needs no host round trip either, and copies nothing
(one step in ``REFRESH_STEPS`` copies its misses in, as without, so that the cache keeps up).

A token's experts are read once per assignment: meant for decode-sized steps (``ROWS``), where
the grouped paths would read each expert once too. Accumulation is in float32 (the projections of
the CPU and cached paths accumulate in float32 too, and round between them to the weights' dtype).
"""

from __future__ import annotations

import torch

from typing import Callable, NamedTuple

from ..env import switch
from ..layers.moe import Gathered, Routing, StackedExperts

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (CPU-only torch): available() is False
    triton = None

# On by default since the fourteenth GPU session: Qwen3-30B-A3B decode at 8 GiB went from 4.1
# (experts on the CPU) to 12.4 tok/s, at 82% of the PCIe bound (docs/BENCHMARKS.md).
ENABLED = switch("VRAMSHARD_EXPERTS_ZERO_COPY", default=True)
ROWS = 4  # the most tokens of a step computed this way (decode and small decode batches)
# With a VRAM expert cache, every REFRESH_STEPS-th decode step takes the cache's own path instead,
# copying its misses in: the cache keeps learning which experts the routers pick (kernel steps
# read and admit nothing), at one step's copies in REFRESH_STEPS.
REFRESH_STEPS = 8
BLOCK_F, BLOCK_D, BLOCK_K = 8, 8, 512  # rows of a program's weight block, and its columns per loop
# Steps of more than ROWS tokens, up to this many, whose experts the cache can hold at once
# (:func:`routed_through_cache`): the copy engine brings each missing expert in once, then the
# kernels read every assignment from the cache's slots in VRAM. The grouped path it replaces ran
# each expert's gather, matmuls and scatter-add from the host: ~81 experts a layer at 16 tokens of
# qwen3-30b-a3b, 1155 ms a step on the H200 machine where its copies alone take 684 ms.
CACHED_ROWS = 64


class CachedSource(NamedTuple):
    """A VRAM expert cache as the kernels read it: its slots as one row each ([slots, 2F, D] /
    [slots, D, F] views) and the layer's slot of each expert ([E] int32 on the GPU, -1: not cached)."""

    slots: StackedExperts
    slot_of: torch.Tensor


def cpu_expert_count(share: float, experts: int) -> int:
    """How many of a step's ``experts`` the CPU takes at ``share`` (of the work both sides could do
    alone in the same time): the whole count next to ``share * experts`` at which the slower side
    finishes first. With ``share = t_gpu / (t_cpu + t_gpu)`` a side's time is ``n (1 - share)`` on the
    CPU and ``(experts - n) share`` on the GPU (in units of ``t_cpu + t_gpu``)."""
    low = int(share * experts)
    return min((low, min(low + 1, experts)), key=lambda n: (max(n * (1 - share), (experts - n) * share), n))


# The oldest GPUs the kernels are meant for: Ampere (RTX 30xx, A100) and newer, whose Triton loads
# bfloat16 natively. They have run on Hopper (sm_90) only; older GPUs compute host experts on the CPU.
MIN_CAPABILITY = (8, 0)


def supported() -> bool:
    """Whether host experts can be read by the GPU's kernels here: Triton, and a GPU of compute
    capability ``MIN_CAPABILITY`` or newer."""
    return triton is not None and torch.cuda.is_available() and torch.cuda.get_device_capability() >= MIN_CAPABILITY


def available() -> bool:
    """Whether host experts will be read by the GPU's kernels here: asked for, and supported."""
    return ENABLED and supported()


if triton is not None:

    @triton.jit
    def _expert_base(experts_ptr, a, w_ptr, stride_e, slot_ptr, cache_ptr, cache_stride_e, HAS_CACHE: tl.constexpr):
        """Where assignment ``a``'s expert lies (its cache slot if it has one, else host memory),
        and whether it is computed here at all (expert -1: elsewhere; its loads are masked off)."""
        e = tl.load(experts_ptr + a).to(tl.int64)
        here = e >= 0
        e = tl.maximum(e, 0)
        base = w_ptr + e * stride_e
        if HAS_CACHE:
            slot = tl.load(slot_ptr + e).to(tl.int64)
            base = tl.where(slot >= 0, cache_ptr + slot * cache_stride_e, base)
        return base, here

    @triton.jit
    def _gate_up_act(h_ptr, experts_ptr, w_ptr, act_ptr, top_k, D, F, stride_e, stride_r,
                     slot_ptr, cache_ptr, cache_stride_e,
                     BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr, HAS_CACHE: tl.constexpr):
        """act[a, f] = silu(h[t] · gate[e, f]) · (h[t] · up[e, f]) for a block of f; gate_up [E, 2F, D]."""
        a = tl.program_id(0)
        base, here = _expert_base(experts_ptr, a, w_ptr, stride_e, slot_ptr, cache_ptr, cache_stride_e, HAS_CACHE)
        t = a // top_k
        rows_here = tl.where(here, F, 0)  # (a skipped assignment's loads are all masked off)
        f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
        gate_rows = base + f[:, None].to(tl.int64) * stride_r
        up_rows = gate_rows + F * stride_r
        acc_gate = tl.zeros((BLOCK_F,), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_F,), dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(h_ptr + t * D + k, mask=k < D, other=0.0).to(tl.float32)
            mask = (f[:, None] < rows_here) & (k[None, :] < D)
            gate = tl.load(gate_rows + k[None, :], mask=mask, other=0.0)
            up = tl.load(up_rows + k[None, :], mask=mask, other=0.0)
            acc_gate += tl.sum(gate.to(tl.float32) * x[None, :], axis=1)
            acc_up += tl.sum(up.to(tl.float32) * x[None, :], axis=1)
        act = acc_gate * tl.sigmoid(acc_gate) * acc_up
        tl.store(act_ptr + a * F + f, act, mask=f < F)

    @triton.jit
    def _down(act_ptr, experts_ptr, weights_ptr, w_ptr, y_ptr, D, F, stride_e, stride_r,
              slot_ptr, cache_ptr, cache_stride_e,
              BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, HAS_CACHE: tl.constexpr):
        """y[a, d] = weight[a] · (down[e, d] · act[a]) for a block of d; down [E, D, F]."""
        a = tl.program_id(0)
        base, here = _expert_base(experts_ptr, a, w_ptr, stride_e, slot_ptr, cache_ptr, cache_stride_e, HAS_CACHE)
        scale = tl.where(here, tl.load(weights_ptr + a).to(tl.float32), 0.0)
        rows_here = tl.where(here, D, 0)
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        rows = base + d[:, None].to(tl.int64) * stride_r
        acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for k0 in range(0, F, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(act_ptr + a * F + k, mask=k < F, other=0.0)
            w = tl.load(rows + k[None, :], mask=(d[:, None] < rows_here) & (k[None, :] < F), other=0.0)
            acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        tl.store(y_ptr + a * D + d, acc * scale, mask=d < D)


def _expert_strides(weight: torch.Tensor, name: str) -> tuple[int, int]:
    """(expert, row) strides of a stacked [E, R, C] weight whose rows are contiguous."""
    if weight.dim() != 3 or weight.stride(2) != 1:
        raise ValueError(f"stacked expert {name} must be [E, rows, cols] with contiguous rows, "
                         f"got shape {tuple(weight.shape)} strides {weight.stride()}")
    return weight.stride(0), weight.stride(1)


def routed_experts(stacked: StackedExperts, h: torch.Tensor, routing: Routing,
                   cache: CachedSource | None = None) -> torch.Tensor:
    """Sum over each token's routed experts of its routing weight times the expert's SwiGLU of
    ``h`` [T, D]: [T, D] in ``h``'s dtype and on its device. The experts' weights are read where
    ``stacked`` lies: VRAM, or pinned host memory (then over PCIe by the kernels themselves); with
    ``cache``, from the cache's slot for the experts it holds. An assignment to expert -1 is
    computed elsewhere (by the CPU, say): it reads nothing and counts zero."""
    T, top_k = routing.experts.shape
    E, two_f, D = stacked.gate_up.shape
    F = two_f // 2
    if h.shape != (T, D) or stacked.down.shape != (E, D, F):
        raise ValueError(f"hidden states {tuple(h.shape)} and experts gate_up {tuple(stacked.gate_up.shape)}, "
                         f"down {tuple(stacked.down.shape)} do not fit {T} tokens of {top_k} experts")
    gate_up_e, gate_up_r = _expert_strides(stacked.gate_up, "gate_up")
    down_e, down_r = _expert_strides(stacked.down, "down")
    if cache is not None:
        slots = cache.slots
        cached_gate_up, cached_down = _expert_strides(slots.gate_up, "cached gate_up"), _expert_strides(slots.down, "cached down")
        if (slots.gate_up.shape[1:], slots.down.shape[1:], cached_gate_up[1], cached_down[1]) != \
                (stacked.gate_up.shape[1:], stacked.down.shape[1:], gate_up_r, down_r) or cache.slot_of.shape != (E,):
            raise ValueError("the expert cache's slots and slot table do not match the layer's experts")
        gate_up_cache = (cache.slot_of, slots.gate_up, cached_gate_up[0])
        down_cache = (cache.slot_of, slots.down, cached_down[0])
    else:  # (any pointer: the kernels do not read them)
        gate_up_cache = down_cache = (stacked.gate_up, stacked.gate_up, 0)
    A = T * top_k
    experts = routing.experts.reshape(A).to(torch.int32)
    weights = routing.weights.reshape(A).to(torch.float32)
    h = h.contiguous()
    act = torch.empty(A, F, dtype=torch.float32, device=h.device)
    y = torch.empty(A, D, dtype=torch.float32, device=h.device)
    _gate_up_act[(A, triton.cdiv(F, BLOCK_F))](h, experts, stacked.gate_up, act, top_k, D, F, gate_up_e, gate_up_r,
                                               *gate_up_cache, BLOCK_F=BLOCK_F, BLOCK_K=BLOCK_K,
                                               HAS_CACHE=cache is not None)
    _down[(A, triton.cdiv(D, BLOCK_D))](act, experts, weights, stacked.down, y, D, F, down_e, down_r, *down_cache,
                                        BLOCK_D=BLOCK_D, BLOCK_K=BLOCK_K, HAS_CACHE=cache is not None)
    return y.view(T, top_k, D).sum(dim=1).to(h.dtype)


def routed_through_cache(stacked: StackedExperts, h: torch.Tensor, routing: Routing,
                         gather: Callable[[list[int]], Gathered | None]) -> torch.Tensor | None:
    """:func:`routed_experts` of a step whose every routed expert is first made cached:
    ``gather`` (:meth:`~vramshard.runtime.expert_cache.CachedExperts.gather`) copies the missing
    ones into the cache's slots, each once, and orders the kernels after those copies, which then
    read only VRAM. ``stacked``: the layer's experts where they lie in host memory (their layout;
    nothing is read from them). The host learns which experts the step routes to (one
    synchronisation, as the grouped path has). None, with nothing done, when the cache cannot hold
    them all at once or has no slots at one stride: the caller's path then."""
    wanted = sorted(set(routing.experts.reshape(-1).tolist()))
    gathered = gather(wanted)
    if gathered is None:
        return None
    try:
        table = torch.full((stacked.gate_up.shape[0],), -1, dtype=torch.int32)
        for expert, slot in gathered.rows.items():
            table[expert] = slot
        if h.device.type == "cuda":  # from pinned memory: a pageable copy would wait for the fills
            table = table.pin_memory().to(h.device, non_blocking=True)
        return routed_experts(stacked, h, routing, CachedSource(gathered.stacked, table))
    finally:
        gathered.release()  # the kernels reading the slots are queued
