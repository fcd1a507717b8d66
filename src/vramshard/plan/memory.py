"""VRAM arithmetic: what a placement needs on the GPU, item by item.

Used by the executor to refuse placements that cannot fit and by the planner to
choose ones that do. Sizes are upper estimates for the CUDA caching allocator.
"""

from __future__ import annotations

import weakref

from dataclasses import dataclass

from ..errors import BudgetError
from ..layers.attention import fused_prompt_attention
from ..layers.mlp import DenseFFN
from ..layers.moe import GATHER_BYTES
from ..layers.rotary import ROTARY_ROWS
from ..models.base import Model
from ..runtime.kv_cache import DEFAULT_BLOCK_SIZE
from ..runtime.vram_coded import vram_bytes as coded_vram_bytes
from ..runtime.wire_codec import STAGING_BYTES, wire_ratio
from ..units import format_bytes
from .placement import Placement

SLOT_ALIGN = 256  # byte alignment of each tensor inside a packed buffer
LOGIT_ROWS = 64  # most logit rows one GPU step computes (decode batch); prompts need one row each
ALLOCATOR_SLACK = 64 * 2**20  # rounding of the caching allocator (2 MiB / 20 MiB segments)
# cuBLAS keeps a workspace per (handle, stream) in the caching allocator for as long as the
# process lives (32 MiB on Hopper, shared with cuBLASLt); the executor's compute stream and the
# default stream run matmuls.
CUBLAS_WORKSPACES = 2 * 32 * 2**20


def align(n: int, to: int = SLOT_ALIGN) -> int:
    return (n + to - 1) // to * to


def packed_bytes(sizes) -> int:
    """Bytes of a buffer holding tensors of the given sizes, each aligned."""
    return sum(align(n) for n in sizes)


@dataclass(frozen=True)
class VramNeed:
    """What a placement needs on the GPU."""

    resident: int  # weights pinned in VRAM
    slots: int  # ring of slots for streamed weights (and the coded fills' staging: wire_staging_bytes)
    kv: int  # KV cache of GPU-attention layers
    workspace: int  # activations of the largest step, allocator slack
    experts: int = 0  # MoE split layers: their routers in VRAM, and the VRAM expert cache
    kv_staging: int = 0  # one layer's KV, staged from host memory for GPU attention over a host KV cache

    @property
    def total(self) -> int:
        return self.resident + self.slots + self.kv + self.workspace + self.experts + self.kv_staging

    def breakdown(self) -> str:
        text = (f"resident weights {format_bytes(self.resident)}, slots {format_bytes(self.slots)}, "
                f"KV cache {format_bytes(self.kv)}, workspace {format_bytes(self.workspace)}")
        if self.experts:
            text += f", routers and expert cache {format_bytes(self.experts)}"
        if self.kv_staging:
            text += f", KV staging {format_bytes(self.kv_staging)}"
        return text

    def check(self, budget: int | None, what: str = "this placement") -> None:
        if budget is not None and self.total > budget:
            raise BudgetError(
                f"{what} needs {format_bytes(self.total)} of VRAM ({self.breakdown()}) but the budget is "
                f"{format_bytes(budget)}; raise --vram to at least {format_bytes(self.total)} or choose a "
                "placement that keeps less on the GPU"
            )


def sublayer_packed_bytes(model: Model, name: str) -> int:
    return packed_bytes(spec.nbytes for spec in model[name].weights)


def split_part_bytes(model: Model, name: str, cpu_pieces: int) -> int:
    """Slot bytes of the GPU part of dense FFN ``name`` split with ``cpu_pieces`` pieces on the CPU:
    its norm, then gate and up rows of the other pieces back to back, then their rows of the
    transposed down (as :class:`~vramshard.runtime.host_weights.SplitPart` lays them out)."""
    sublayer = model[name]
    bounds = sublayer.bounds if isinstance(sublayer, DenseFFN) else ()
    if not bounds or not 0 < cpu_pieces < len(bounds) - 1:
        raise ValueError(f"{name} cannot be split with {cpu_pieces} pieces on the CPU")
    norm = next(spec for spec in sublayer.weights if spec.key == "post_attention_layernorm")
    part = sublayer.part_bytes(cpu_pieces, len(bounds) - 1) // 3  # one matrix's rows
    return align(norm.nbytes) + align(2 * part) + align(part)


def streamed_bytes(model: Model, name: str, where) -> int:
    """Bytes one stream-slot fill of sub-layer ``name`` placed at ``where`` copies (and needs)."""
    if where.split:
        return split_part_bytes(model, name, where.cpu_pieces)
    return sublayer_packed_bytes(model, name)


def kv_positions(kv_slots: int, max_context: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Positions a KV cache of ``kv_slots`` rows of ``max_context`` holds: rows round up to whole blocks."""
    return kv_slots * -(-max_context // block_size) * block_size


def kv_staging_bytes(model: Model, kv_slots: int, max_context: int) -> int:
    """VRAM of the staging cache of GPU attention over a host-memory KV cache: keys and values of
    one layer for the whole pool (a step never needs more blocks than the host pool holds), reused
    by every staged layer (:mod:`~vramshard.runtime.kv_staging`)."""
    a = model.args
    return 2 * kv_positions(kv_slots, max_context) * a.num_key_value_heads * a.head_dim * model.dtype.itemsize


def attention_workspace_bytes(model: Model, max_tokens: int, max_context: int, kv_slots: int = 1) -> int:
    """Peak temporaries of one GPU attention sub-layer (upper estimate), over the step shapes a
    ``max_tokens`` step can take: one sequence of up to ``max_tokens`` new tokens, or a batch of
    up to ``min(kv_slots, max_tokens)`` sequences, each over up to ``max_context`` cached keys.

    A masked or batched attention may run PyTorch's math kernel, which repeats the grouped keys
    and values to every head, upcasts them to float32, and materialises the scores and their
    softmax in float32; a batch also gathers each sequence's KV blocks (padded to the longest).
    One sequence's prompt chunk in the flash kernel (:func:`fused_prompt_attention`) holds only
    its output and softmax statistics.
    """
    a = model.args
    item = model.dtype.itemsize
    heads, kv_heads, dim = a.num_attention_heads, a.num_key_value_heads, a.head_dim
    ctx = -(-max_context // DEFAULT_BLOCK_SIZE) * DEFAULT_BLOCK_SIZE
    fused = fused_prompt_attention(model.dtype, dim)

    def one(batch: int, queries: int) -> int:
        if batch == 1 and fused:
            return queries * heads * (dim * item + 4)  # output, and the log-sum-exp per row (float32)
        gathered = 2 * batch * ctx * kv_heads * dim * item if batch > 1 else 0  # k, v of the batch's blocks
        repeated = 2 * batch * ctx * heads * dim * (item + 4)  # k, v repeated per head, and as float32
        scores = 2 * batch * heads * queries * ctx * 4  # scores and softmax, float32
        query = batch * queries * heads * dim * (2 * item + 4)  # padded query, float32 copy, output
        mask = batch * queries * ctx * 4
        return gathered + repeated + scores + query + mask

    batch = max(1, min(kv_slots, max_tokens))
    single = one(1, max_tokens) if max_tokens > 1 else 0  # one token: a fused kernel, no scores
    return max(single, one(batch, -(-max_tokens // batch)) if batch > 1 else 0)


def moe_workspace_bytes(model: Model, max_tokens: int) -> int:
    """Peak temporaries of one MoE FFN on the GPU beyond the per-token activations (upper estimate).

    Routing: router logits, float32 probabilities, top-k weights and indices. Grouped path
    (:meth:`~vramshard.layers.moe.MoEFFN._run_grouped`): the sorted assignments and their
    token indices and weights (int64 / activation dtype), the output accumulator, and one
    expert's activations when every token routes to it. Gathered path: the gathered expert
    weights of a few-token step (at most ``GATHER_BYTES``).
    """
    moe = model.args.moe
    if moe is None:
        return 0
    item = model.dtype.itemsize
    d, f, k, e = model.args.hidden_size, moe.intermediate_size, moe.top_k, moe.num_experts
    t = max_tokens
    routing = t * e * (item + 4 + 4) + t * k * (8 + 4 + 2 * item)
    assignments = t * k * (8 * 3 + item * 2)  # order, token_of, bincount, weight_of, scaled weights
    expert = t * (3 * d + 3 * f) * item  # h[tokens], gate_up, act, y, y * w (all tokens on one expert)
    return routing + assignments + t * d * item + max(expert, GATHER_BYTES)


def workspace_bytes(model: Model, max_tokens: int, max_context: int, max_logit_rows: int | None = None,
                    kv_slots: int = 1) -> int:
    """Peak activation memory of one GPU step of ``max_tokens`` new tokens (upper estimate) for up to
    ``kv_slots`` sequences of up to ``max_context`` tokens, plus the allocator's rounding and the
    cuBLAS workspaces."""
    a = model.args
    item = model.dtype.itemsize
    rows = min(max_tokens, LOGIT_ROWS) if max_logit_rows is None else max_logit_rows
    ffn = a.moe.intermediate_size * a.moe.top_k if a.moe else a.intermediate_size
    qkv = (a.num_attention_heads + 2 * a.num_key_value_heads) * a.head_dim
    per_token = item * (4 * a.hidden_size + 3 * qkv + 3 * ffn)
    attention = attention_workspace_bytes(model, max_tokens, max_context, kv_slots)
    moe = moe_workspace_bytes(model, max_tokens)
    logits = rows * a.vocab_size * (item + 4 + 4)  # head output, fp32 copy, sampling
    peak = 2 * max_tokens * per_token + max(attention, moe) + logits
    return align(peak, 2**20) + ALLOCATOR_SLACK + CUBLAS_WORKSPACES


def moe_layers(model: Model) -> list[int]:
    """Layers whose FFN is a Mixture of Experts (whose experts are placement pieces)."""
    return [s.layer for s in model if s.kind == "ffn" and any(spec.piece != "main" for spec in s.weights)]


def main_piece_bytes(model: Model, name: str) -> int:
    """Packed bytes of a sub-layer's ``main`` piece (a MoE FFN's norm and router)."""
    return packed_bytes(spec.nbytes for spec in model[name].weights if spec.piece == "main")


_expert_slots: dict[int, int] = {}  # id(model) -> bytes, dropped with the model


def expert_slot_bytes(model: Model) -> int:
    """Bytes of one VRAM expert-cache slot: the largest packed expert of any MoE layer (computed
    once per model: a MoE model has thousands of expert tensors, and the planner asks often)."""
    if id(model) in _expert_slots:
        return _expert_slots[id(model)]
    best = 0
    for sublayer in model:
        sizes: dict[str, int] = {}
        for spec in sublayer.weights:
            if spec.piece != "main":
                sizes[spec.piece] = sizes.get(spec.piece, 0) + align(spec.nbytes)
        best = max(best, max(sizes.values(), default=0))
    _expert_slots[id(model)] = best
    weakref.finalize(model, _expert_slots.pop, id(model), None)
    return best


def expert_split_bytes(model: Model, placement: Placement) -> int:
    """VRAM of the routers (main pieces) of the sub-layers ``placement`` splits at their experts
    (one buffer for all of them, rounded as the allocator rounds it)."""
    return split_router_bytes(model, placement.expert_names())


def split_router_bytes(model: Model, names) -> int:
    """Bytes of the one VRAM buffer that holds the main pieces of the split sub-layers ``names``."""
    total = sum(main_piece_bytes(model, name) for name in names)
    return align(total, 2 * 2**20) if total else 0  # the allocator rounds large blocks to 2 MiB


def vram_need(model: Model, placement: Placement, kv_slots: int, max_context: int, max_tokens: int,
              num_slots: int = 2, max_logit_rows: int | None = None, expert_cache: int = 0,
              wire_coded: bool | None = None) -> VramNeed:
    """VRAM a placement needs for ``kv_slots`` sequences of up to ``max_context`` tokens.

    expert_cache: bytes of the VRAM expert cache, counted when the placement caches experts.
    wire_coded: whether its stream fills cross the link coded (their staging buffer counted with the
    slots); None: as the estimator prices the link (:func:`wire_staging_bytes`).
    """
    where = placement.as_dict()
    resident = 0
    streamed = []
    gpu_attention = 0
    for sublayer in model:
        w = where[sublayer.name]
        if w.home == "vram" and w.coded:  # held coded, decoded into a slot of the ring each step
            resident += coded_vram_bytes(sublayer_packed_bytes(model, sublayer.name))
            streamed.append(sublayer_packed_bytes(model, sublayer.name))
        elif w.home == "vram":
            resident += sublayer_packed_bytes(model, sublayer.name)
        elif w.home == "stream":
            streamed.append(streamed_bytes(model, sublayer.name, w))
        if sublayer.kind == "attn" and w.kv_in_vram:
            gpu_attention += 1
    a = model.args
    kv = 2 * gpu_attention * kv_positions(kv_slots, max_context) * a.num_key_value_heads * a.head_dim \
        * model.dtype.itemsize
    uses_gpu = placement.uses_gpu
    return VramNeed(
        resident=resident,
        slots=num_slots * max(streamed, default=0) + wire_staging_bytes(model, wire_coded) if streamed else 0,
        kv=kv,
        workspace=workspace_bytes(model, max_tokens, max_context, max_logit_rows, kv_slots) if uses_gpu else 0,
        experts=expert_split_bytes(model, placement) + (expert_cache if placement.expert_names("cache") else 0),
        kv_staging=kv_staging_bytes(model, kv_slots, max_context) if placement.staged_kv_names() else 0,
    )


def wire_staging_bytes(model: Model, wire_coded: bool | None = None) -> int:
    """VRAM the coded stream fills stage their blocks in (:mod:`~vramshard.runtime.wire_codec`): its
    staging buffer where this model's fills cross the link coded, else 0. ``wire_coded``: whether the
    executor codes them; None: as the estimator prices the link."""
    from .mechanisms import wire_codec_enabled

    coded = wire_codec_enabled() if wire_coded is None else wire_coded
    return STAGING_BYTES if wire_ratio(model.dtype, coded) < 1 else 0


def max_resident_layers(model: Model, budget: int, kv_slots: int, max_context: int, max_tokens: int) -> int:
    """The most whole layers (``layers:N``) whose weights and KV fit the budget."""
    from .placement import named_placement

    triples = sublayer_triples(model)
    num_layers = model.args.num_hidden_layers
    best = 0
    for n in range(num_layers + 1):
        need = vram_need(model, named_placement(f"layers:{n}", triples, num_layers), kv_slots,
                         max_context, max_tokens)
        if need.total <= budget:
            best = n
        else:
            break
    return best


def sublayer_triples(model: Model) -> list[tuple[str, str, int | None]]:
    return [(s.name, s.kind, s.layer) for s in model]


def tiered_vram_need(model: Model, plans, kv_slots: int, max_context: int, max_tokens: int,
                     num_slots: int = 2, expert_cache: int = 0, wire_coded: bool | None = None) -> VramNeed:
    """VRAM of a :class:`TieredPlacement`: shared resident weights, the largest ring, KV, workspace,
    the routers of every sub-layer some tier splits at its experts, the expert cache, and the KV
    staging cache when some tier runs GPU attention over a host KV cache. ``wire_coded``: as for
    :func:`vram_need`."""
    needs = [vram_need(model, p, kv_slots, max_context, max_tokens, num_slots, wire_coded=wire_coded)
             for p in plans.placements]
    split = {name for p in plans.placements for name in p.expert_names()}
    caches = any(p.expert_names("cache") for p in plans.placements)
    experts = split_router_bytes(model, split) + (expert_cache if caches else 0)
    return VramNeed(resident=needs[0].resident, slots=max(n.slots for n in needs),
                    kv=max(n.kv for n in needs), workspace=max(n.workspace for n in needs), experts=experts,
                    kv_staging=max(n.kv_staging for n in needs))


def vision_workspace_bytes(model: Model, patches: int, memory_efficient: bool = True,
                           mlp_rows: int = 4096) -> int:
    """Peak VRAM the vision phase reserves for its activations for ``patches`` patches (upper estimate).

    The largest of its stages: patch embedding (float32 pixels and their cast), a block's
    attention (rotary in float32, then the gathered segments), a block's MLP and the merger,
    plus the rotary tables that live through the pass. With ``memory_efficient`` (fused
    attention kernels, MLP over row chunks of ``mlp_rows``) nothing grows faster than the
    patches; without it, a full-attention block materializes the scores [heads, patches,
    patches] of the largest image (and their softmax).
    """
    v = model.args.vision
    item = model.dtype.itemsize
    n, d, f = patches, v.hidden_size, v.intermediate_size
    embed = n * v.patch_dim * (4 + item) + n * d * item
    # x, qkv (3), the rotated q and k (2), and the float32 temporaries of one row chunk of
    # ``apply_rotary_float32`` (the chunk, its rotation, two products and their sum) ...
    rotary = n * item * 6 * d + min(n, ROTARY_ROWS) * d * 4 * 6
    # ... then x, qkv (3), rotated q, k (2), gathered q, k, v (3), attention output, projection.
    attention = n * item * 11 * d
    rows = min(n, mlp_rows) if memory_efficient else n
    mlp = n * d * item + rows * (2 * d + 4 * f) * item
    groups = n // v.merge_unit
    merger = n * d * item * 2 + groups * (2 * d * v.merge_unit + 2 * v.out_hidden_size) * item
    tables = n * 2 * v.head_dim * 4  # cos, sin (float32)
    scores = 0 if memory_efficient else 2 * v.num_heads * n * n * max(item, 4)
    # The caching allocator reserves more than is live: blocks freed by one stage are split and
    # reused by the next, and a request larger than any free block takes a new segment. At 1440p
    # (2 GiB plan, H200, benchmarks/vlm_memory.py) its reserved growth was 4.3 [n, d] tensors above
    # the stage peaks counted here; this keeps 5.
    fragmentation = 5 * n * d * item
    peak = max(embed, rotary, attention + scores, mlp, merger) + tables + fragmentation
    return align(peak, 2**20) + ALLOCATOR_SLACK
