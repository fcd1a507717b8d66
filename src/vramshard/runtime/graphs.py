"""CUDA graphs for decode steps over a run of GPU-resident sub-layers.

A decode step with every weight in VRAM is bound by Python and kernel launches (some 1,700
launches per step for an 8B model), not by HBM. :class:`DecodeGraphs` captures, per bucket of
(padded batch size, padded key length), one ``torch.cuda.CUDAGraph`` of a fixed-shape forward
(:class:`StaticDecode`) over a contiguous run of resident sub-layers, and replays it: the
step's few index arrays are packed on the host, copied into the bucket's static buffers with one
transfer, the graph is replayed and the output buffer read.

Steps the graphs do not cover run the eager path (:meth:`DecodeGraphs.run` returns None and
logs the reason once): prefill chunks or several tokens per sequence, multimodal inputs,
contexts beyond the largest key bucket, batches beyond the largest batch bucket, sub-layers that
are not resident or not supported (MoE FFNs route with a host sync), KV caches off the device.

``capture=False`` runs the same fixed-shape forward with the same padded buffers eagerly (also
on the CPU): the tests check it against the normal path without a GPU.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch

from ..layers.attention import Attention
from ..layers.embedding import Embedding, Head
from ..layers.mlp import DenseFFN
from ..layers.rotary import cos_sin
from ..layers.static_attention import DecodeIndex, attention_output, decode_mask, static_attend
from ..layers.step import Step
from ..layers.sublayer import SubLayer
from ..plan.placement import GPU_RESIDENT, Placement
from .streams import process_stream

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# Graphs kept. A plan that splits FFNs between CPU and GPU leaves each resident attention a run of
# its own (some 25 runs for llama3-8b at 8 GiB), each captured per (batch, keys) bucket; all
# share one memory pool, so a graph adds little more than its static output.
MAX_GRAPHS = 512
MIN_KEY_BUCKET = 64
SUPPORTED = (Embedding, Attention, DenseFFN, Head)  # sub-layers whose decode forward needs no host sync
_FIXED_COLUMNS = 4  # token, position, write index, write source; then the block table


# ---------------------------------------------------------------------------- buckets and coverage
def batch_bucket(sequences: int, buckets: Sequence[int] = BATCH_BUCKETS) -> int | None:
    """The smallest batch bucket >= ``sequences`` (None: more than the largest)."""
    return next((b for b in buckets if b >= sequences), None)


def key_buckets(max_context: int, smallest: int = MIN_KEY_BUCKET) -> tuple[int, ...]:
    """Key-length buckets: powers of two from ``smallest`` below ``max_context``, then ``max_context``."""
    buckets, size = [], smallest
    while size < max_context:
        buckets.append(size)
        size *= 2
    return tuple(buckets) + (max_context,)


def key_bucket(context: int, buckets: Sequence[int]) -> int | None:
    """The smallest key bucket >= ``context`` (None: longer than the largest)."""
    return next((b for b in buckets if b >= context), None)


def decode_uncovered(step: Step) -> str | None:
    """Why ``step`` is not a plain decode step (None: it is one): one new token per sequence,
    no multimodal inputs."""
    if any(n != 1 for n in step.lengths):
        return "prefill or several new tokens per sequence"
    if step.rope_positions is not None or step.input_embeds is not None:
        return "multimodal inputs (rope_positions / input_embeds)"
    return None


def resident_runs(placement: Placement, sublayers: Sequence[SubLayer], shortest: int = 1) -> list[tuple[int, int]]:
    """Index ranges [begin, end) of ``sublayers`` that are runs of at least ``shortest`` consecutive
    sub-layers computed on the GPU from VRAM-resident weights and supported by :class:`StaticDecode`."""
    where = placement.as_dict()
    runs, begin = [], None
    for i, sublayer in enumerate(list(sublayers) + [None]):
        ok = sublayer is not None and where[sublayer.name] == GPU_RESIDENT and isinstance(sublayer, SUPPORTED)
        if ok and begin is None:
            begin = i
        elif not ok and begin is not None:
            if i - begin >= shortest:
                runs.append((begin, i))
            begin = None
    return runs


SEGMENT = 20 * 2**20  # the CUDA caching allocator's segment for blocks of 1-10 MiB
SMALL_SEGMENT = 2 * 2**20  # its segment for blocks under 1 MiB (a capture's outputs at a few sequences)


def capture_bytes(sublayers: Sequence[SubLayer], batch: int, keys: int, dtype: torch.dtype) -> int:
    """A generous estimate of the VRAM one capture of a (``batch``, ``keys``) bucket adds to the graph
    pool, checked against the room the budget leaves before capturing: four times the largest
    sub-layer's temporaries (gathered keys and values with their scores, the FFN's intermediate
    activations, float32 logits) plus two allocator segments, in whole segments. Measured pools for
    one sequence at 2048 keys of an 8B model: 24-56 MiB; this gives 80 MiB there."""
    item = dtype.itemsize
    largest = 0
    for s in sublayers:
        if isinstance(s, Attention):
            need = 2 * batch * keys * s.num_kv_heads * s.head_dim * item + batch * s.num_heads * keys * 4
        elif isinstance(s, DenseFFN):
            need = 3 * batch * s.intermediate * item
        elif isinstance(s, Head):
            need = batch * s.vocab * (4 + item)
        else:
            need = 0
        largest = max(largest, need)
    return -(-(4 * largest + 2 * SEGMENT) // SEGMENT) * SEGMENT


# ---------------------------------------------------------------------------- the fixed-shape forward
def pack_decode_inputs(step: Step, geometry: tuple[int, int] | None, out: torch.Tensor,
                       tokens: torch.Tensor | None = None) -> None:
    """Fill ``out`` [B_pad, 4 + nb] int64 (host) with the step's indices for :class:`StaticDecode`.

    Columns: token id, position, write index (flat pool row of the new key), write source, then
    the blocks holding positions 0 .. nb * block_size - 1. Rows beyond the step's sequences repeat
    row 0's write (see :mod:`~vramshard.layers.static_attention`). geometry: (block_size,
    blocks_per_slot) of the KV cache (None: the run has no attention). tokens: ids [B] on the host.
    """
    batch, nb = out.shape[0], out.shape[1] - _FIXED_COLUMNS
    rows = []
    if geometry is None:
        rows = [[0, start, 0, b] + [0] * nb for b, start in enumerate(step.starts)]
    else:
        size, per_slot = geometry
        tables = step.block_tables if step.block_tables is not None else \
            [range(slot * per_slot, (slot + 1) * per_slot) for slot in step.slots]
        for b, (table, start) in enumerate(zip(tables, step.starts)):
            assert len(table) * size > start, "a block table must cover the step's positions"
            blocks = list(table[:nb])
            rows.append([0, start, table[start // size] * size + start % size, b]
                        + blocks + [blocks[0]] * (nb - len(blocks)))
    first = rows[0]
    rows += [[0, 0, first[2], 0] + first[_FIXED_COLUMNS:]] * (batch - len(rows))
    out.copy_(torch.tensor(rows, dtype=torch.long))
    if tokens is not None:
        out[: step.num_seqs, 0] = tokens


class CompiledOrEager:
    """``fn`` through ``torch.compile`` (whole graph), or ``fn`` itself from the first time compiling
    fails (no Triton, an unsupported operation): said once in the log. Shapes are static at first;
    a second batch bucket makes torch recompile with the batch size symbolic, so the buckets share
    one compiled function instead of one each (each CUDA graph still captures its own shapes)."""

    def __init__(self, fn: Callable, backend: str):
        from ..layers.cpu_compiled import keep_compiled_in_user_cache

        keep_compiled_in_user_cache()
        self.fn = fn
        self.compiled = torch.compile(fn, backend=backend, fullgraph=True)
        self.failed: str | None = None

    def __call__(self, *args):
        if self.failed is None:
            try:
                return self.compiled(*args)
            except Exception as exc:  # the eager function below raises again if the fault is not the compiler's
                self.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                log.warning("torch.compile of %s failed (%s): decode steps run it uncompiled",
                            getattr(self.fn, "__qualname__", self.fn), self.failed)
        return self.fn(*args)


_compiled: dict[tuple, CompiledOrEager] = {}


def compiled(fn: Callable, backend: str) -> CompiledOrEager:
    """One compiled wrapper per function and backend for the process: every layer of every run
    shares it (the compiled code depends on shapes and sub-layer settings, not on which layer)."""
    key = (fn, backend)
    if key not in _compiled:
        _compiled[key] = CompiledOrEager(fn, backend)
    return _compiled[key]


@dataclass(frozen=True)
class _Segment:
    """A stretch of the fixed-shape forward with no attention over the KV cache in it: the output
    projection and residual of the attention before it (``post``), whole sub-layers, then the
    norm, projections and rotary of the attention after it (``pre``, which returns q, k, v).
    Nothing in it depends on the key length, so a compiler sees it as one function of the batch
    size: the residual adds fuse with the norms after them, the rotary and the SwiGLU element-wise
    ops into one kernel each. (Storing the new key and value stays out: inside, inductor made a
    copy of the whole KV pool and copied it back, on the H200 in the ninth session.)"""

    post: Attention | None
    middle: tuple[SubLayer, ...]
    pre: Attention | None


def decode_segments(sublayers: Sequence[SubLayer]) -> list[_Segment | Attention]:
    """``sublayers`` as :class:`_Segment` s and the attention cores between them (the attention
    sub-layer itself stands for its core: KV write, gather, attention kernel)."""
    pieces: list[_Segment | Attention] = []
    post, middle = None, []
    for sublayer in sublayers:
        if isinstance(sublayer, Attention):
            pieces += [_Segment(post, tuple(middle), sublayer), sublayer]
            post, middle = sublayer, []
        else:
            middle.append(sublayer)
    if post is not None or middle:
        pieces.append(_Segment(post, tuple(middle), None))
    return pieces


def run_segment(segment_parts: tuple, weights: tuple, x: torch.Tensor, out: torch.Tensor | None,
                cos: torch.Tensor | None, sin: torch.Tensor | None, step: Step):
    """One :class:`_Segment` (given as its ``(post, middle, pre)``, with their weights in the same
    shape) on x [B, D]; ``out``: the output [B, H, D] of the attention core before it. Returns x and
    the (q, k, v) of the attention after it (None when the segment ends the run)."""
    post, middle, pre = segment_parts
    post_w, middle_w, pre_w = weights
    if post is not None:
        x = attention_output(x, out, post_w["o_proj"])
    for sublayer, w in zip(middle, middle_w):
        x = sublayer.forward(w, x, step)
    return x, pre.qkv(pre_w, x, cos, sin) if pre is not None else None


def _first_segment(*args):
    return run_segment(*args)


def _middle_segment(*args):
    return run_segment(*args)


def _last_segment(*args):
    return run_segment(*args)


def _lone_segment(*args):
    return run_segment(*args)


def _batch_is_dynamic(*tensors: torch.Tensor | None) -> None:
    """Let torch.compile treat dim 0 (the batch bucket) of these segment inputs as symbolic, so one
    compiled variant serves every bucket above one row (a row of one is always specialised). Only
    the warm-up and capture calls run this: a graph replay runs none of the Python."""
    for tensor in tensors:
        if tensor is not None and tensor.shape[0] > 1:
            torch._dynamo.maybe_mark_dynamic(tensor, 0)


# One function per kind of segment, by (starts after an attention, ends before one): torch.compile
# keeps a cache of compiled variants per function, so the kinds do not crowd each other out of it.
SEGMENT_FUNCTIONS = {(False, True): _first_segment, (True, True): _middle_segment,
                     (True, False): _last_segment, (False, False): _lone_segment}


class StaticDecode:
    """The fixed-shape decode forward of a run of sub-layers (see :mod:`~vramshard.layers.static_attention`).

    weights: resident weights by sub-layer name. device: where they live; rotary frequencies are
    copied there once here, so the forward itself never moves a tensor between devices.
    compile_backend: run each stretch between two attention cores (:func:`decode_segments`: output
    projection, residual, FFN, the next norm, projections and rotary) through ``torch.compile``
    with this backend (None: eagerly). One compiled function serves every layer and batch bucket.
    Writing and gathering the KV cache and the attention kernel stay eager: they depend on the key
    length, which would make a compile per key bucket.
    """

    def __init__(self, sublayers: Sequence[SubLayer], weights: Mapping[str, Mapping[str, torch.Tensor]],
                 device: torch.device, compile_backend: str | None = None):
        self.sublayers = list(sublayers)
        self.starts_with_tokens = isinstance(self.sublayers[0], Embedding)
        self.ends_with_logits = isinstance(self.sublayers[-1], Head)
        body = self.sublayers[1:] if self.starts_with_tokens else self.sublayers  # the gather stays eager
        self.weights = [weights[s.name] for s in self.sublayers]
        self._embed_w = weights[self.sublayers[0].name] if self.starts_with_tokens else None
        self.pieces = []
        for piece in decode_segments(body):
            if isinstance(piece, Attention):
                self.pieces.append(piece)
                continue
            fn = SEGMENT_FUNCTIONS[piece.post is not None, piece.pre is not None]
            parts = (piece.post, piece.middle, piece.pre)
            self.pieces.append((fn if compile_backend is None else compiled(fn, compile_backend), parts,
                                (weights[piece.post.name] if piece.post else None,
                                 tuple(weights[s.name] for s in piece.middle),
                                 weights[piece.pre.name] if piece.pre else None)))
        self.compiles = compile_backend is not None
        self.attention = [s for s in self.sublayers if isinstance(s, Attention)]
        # Layers whose rotary frequencies agree share one cos/sin table per step.
        self._rope_group: dict[str, int] = {}
        self._inv_freq: list[torch.Tensor] = []
        for attn in self.attention:
            group = next((g for g, f in enumerate(self._inv_freq) if torch.equal(f.cpu(), attn.inv_freq)), None)
            if group is None:
                group = len(self._inv_freq)
                self._inv_freq.append(attn.inv_freq.to(device))
            self._rope_group[attn.name] = group
        self._no_step = Step([0], [0], [1])  # embed / ffn / head read nothing from it; logit rows: all

    def __call__(self, x: torch.Tensor, ints: torch.Tensor, kv, key_positions: torch.Tensor) -> torch.Tensor:
        """x: hidden states [B, D] (ignored when the run starts at ``embed``); ints [B, 4 + nb] from
        :func:`pack_decode_inputs` on the device; kv: layer → its cache; key_positions: 0 .. L-1 [L].
        Returns float32 logits [B, V] (run ends at ``head``) or hidden states [B, D]."""
        positions = ints[:, 1]
        index = DecodeIndex(positions, ints[:, 2], ints[:, 3], ints[:, _FIXED_COLUMNS:],
                            decode_mask(positions, key_positions))
        if self.starts_with_tokens:
            x = self.sublayers[0].forward(self._embed_w, ints[:, 0], self._no_step)
        tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        out = qkv = None
        for piece in self.pieces:
            if isinstance(piece, Attention):
                out = static_attend(*qkv, kv(piece.layer), index)
                continue
            segment, parts, weights = piece
            cos = sin = None
            pre = parts[2]
            if pre is not None:
                group = self._rope_group[pre.name]
                if group not in tables:
                    tables[group] = cos_sin(self._inv_freq[group], positions, x.dtype)
                cos, sin = tables[group]
            if self.compiles:
                _batch_is_dynamic(x, out, cos, sin)
            x, qkv = segment(parts, weights, x, out, cos, sin, self._no_step)
        return x


# ---------------------------------------------------------------------------- the graph runner
@dataclass
class _Indices:
    """A step's indices (:func:`pack_decode_inputs`) for every run of one shape and KV geometry:
    the runs of a step read the same ones, so they are packed and copied once a step (a plan that
    splits FFNs has some 30 runs a step; ``benchmarks/pack_indices.py`` times one pack)."""

    ints: torch.Tensor  # [batch, 4 + nb] int64 on the device
    staging: torch.Tensor  # the same on the host (pinned with CUDA)
    copied: torch.cuda.Event | None = None  # the last host → device copy out of ``staging``
    step: Callable[[], Step | None] | None = None  # (a weak reference to) the step they hold


@dataclass
class _Bucket:
    """Static buffers (and, once captured, the graph) of one run at one (batch, keys) bucket."""

    batch: int
    keys: int
    indices: _Indices  # shared with the runs of the same shape
    key_positions: torch.Tensor  # [keys] int64 on the device
    hidden: torch.Tensor | None  # [batch, D] input of a run that does not start at embed
    graph: torch.cuda.CUDAGraph | None = None
    output: torch.Tensor | None = None
    estimate: int = 0  # capture_bytes of its run, charged against the pool limit


@dataclass
class GraphStats:
    """Counters since the runner was made: steps replayed, run eagerly in fixed shapes, captured,
    evicted, and steps left to the eager path by reason."""

    replays: int = 0
    static_eager: int = 0
    captures: int = 0
    evictions: int = 0
    capture_seconds: float = 0.0
    fallbacks: dict[str, int] = field(default_factory=dict)


class DecodeGraphs:
    """Captures and replays decode steps of runs of resident sub-layers, one graph per bucket.

    weights: resident weights by sub-layer name (the executor's ``resident``); a sub-layer missing
    there is not resident. device: the GPU.
    max_context: the longest context a step may have (the largest key bucket).
    capture: False runs the fixed-shape forward eagerly (tests, and any device without graphs).
    max_graphs: captured graphs kept (least recently used dropped first). pool_limit: bytes the
    graphs' memory pool may reach before no new bucket is captured (None: no limit).
    compile_backend: ``torch.compile`` backend for the fixed-shape forward's fusable parts (None:
    eager kernels; see :class:`StaticDecode`). Compiling happens in the warm-up before a capture.
    """

    def __init__(self, weights: Mapping[str, Mapping[str, torch.Tensor]], device: torch.device | str,
                 max_context: int, capture: bool = True, max_graphs: int = MAX_GRAPHS,
                 batch_buckets: Sequence[int] = BATCH_BUCKETS, smallest_keys: int = MIN_KEY_BUCKET,
                 pool_limit: int | None = None, warmup_runs: int = 2, compile_backend: str | None = None):
        self.compile_backend = compile_backend
        self.weights = weights
        self.device = torch.device(device)
        self.capture = capture
        self.max_graphs = max_graphs
        self.batch_buckets = tuple(sorted(batch_buckets))
        self.key_buckets = key_buckets(max_context, smallest_keys)
        self.pool_limit = pool_limit
        self.warmup_runs = warmup_runs
        self.stats = GraphStats()
        self.pool_bytes = 0  # VRAM the captures added (their private pool), for the budget
        self._largest_estimate = 0  # the largest capture_bytes captured into the pool so far
        self._largest_growth = 0  # the most one capture has grown the pool
        self._forwards: dict[tuple[str, ...], StaticDecode] = {}
        self._buckets: OrderedDict[tuple, _Bucket] = OrderedDict()
        self._pool = None
        self._side_stream = None
        self._told: set[str] = set()
        self._runs: dict[tuple, tuple[Sequence[SubLayer], dict[int, int]]] = {}
        self._inputs: dict[tuple, torch.Tensor] = {}  # (batch, width, dtype) -> the runs' shared input buffer
        self._indices: dict[tuple, _Indices] = {}  # (ints shape, KV geometry) -> the runs' shared indices

    @property
    def graphs(self) -> int:
        """Captured graphs held now."""
        return sum(bucket.graph is not None for bucket in self._buckets.values())

    def clear(self) -> None:
        """Drop every bucket and graph (the weights or KV caches moved). Their pool memory returns to
        the allocator once no graph holds it."""
        self._buckets.clear()
        self._forwards.clear()
        self._runs.clear()
        self._inputs.clear()
        self._indices.clear()
        self._pool = None
        self.pool_bytes = 0
        self._largest_estimate = self._largest_growth = 0

    def charge(self, estimate: int) -> int:
        """VRAM a capture whose :func:`capture_bytes` is ``estimate`` is counted to add to the pool.

        Every capture shares one pool, and a capture's temporaries are free again in the pool once
        it ends, for the next capture to reuse. So a capture no larger (by its estimate) than one
        the pool has held is charged what the pool has grown by at most in one capture, plus a
        small segment for its outputs, not its whole estimate. On the H200 machine 60 captures of
        nemo-8b's lone attentions grew the pool to 6 MiB in all, where each was estimated at
        60 MiB; charged their estimate, the 8 GiB plan's room (about 60 MiB) took one capture at
        1K keys and left the rest of the decode steps eager (docs/BENCHMARKS.md, fifteenth session).
        """
        if self._largest_estimate and estimate <= self._largest_estimate:
            return min(estimate, self._largest_growth + SMALL_SEGMENT)
        return estimate

    def fits(self, estimate: int) -> bool:
        """Whether a capture estimated at ``estimate`` may be made under ``pool_limit``."""
        return self.pool_limit is None or self.pool_bytes + self.charge(estimate) <= self.pool_limit

    def _captured(self, estimate: int, growth: int) -> None:
        """Account a capture estimated at ``estimate`` that grew the pool by ``growth`` bytes."""
        self.pool_bytes += growth
        self._largest_estimate = max(self._largest_estimate, estimate)
        self._largest_growth = max(self._largest_growth, growth)

    def runs(self, placement: Placement, sublayers: Sequence[SubLayer], shortest: int = 1) -> dict[int, int]:
        """{begin: end} of the :func:`resident_runs` of ``sublayers`` under ``placement`` whose sub-layers
        this runner holds weights for (remembered per placement and sub-layer list)."""
        key = (placement, id(sublayers), shortest)
        known = self._runs.get(key)
        if known is None or known[0] is not sublayers:
            runs = {begin: end for begin, end in resident_runs(placement, sublayers, shortest)
                    if all(s.name in self.weights for s in sublayers[begin:end])}
            known = self._runs[key] = (sublayers, runs)
        return known[1]

    def covers(self, sublayers: Sequence[SubLayer], step: Step) -> str | None:
        """Why :meth:`run` would leave ``step`` over ``sublayers`` to the eager path (None: it covers it)."""
        if self.capture and self.device.type != "cuda":
            return f"CUDA graphs need a CUDA device, not {self.device.type}"
        why = decode_uncovered(step)
        if why:
            return why
        if batch_bucket(step.num_seqs, self.batch_buckets) is None:
            return f"more than {self.batch_buckets[-1]} sequences"
        if key_bucket(step.max_context, self.key_buckets) is None:
            return f"context beyond the largest key bucket ({self.key_buckets[-1]})"
        for sublayer in sublayers:
            if sublayer.name not in self.weights:
                return f"{sublayer.name} is not resident in VRAM"
            if not isinstance(sublayer, SUPPORTED):
                return f"{sublayer.name} ({type(sublayer).__name__}) has no fixed-shape decode forward"
        attention = [s for s in sublayers if isinstance(s, Attention)]
        if attention:
            if step.kv_lookup is None:
                return "the step has no KV cache"
            for attn in attention:
                if step.kv(attn.layer).k.device.type != self.device.type:
                    return f"the KV cache of layer {attn.layer} is not on {self.device.type}"
        return None

    @torch.inference_mode()
    def run(self, sublayers: Sequence[SubLayer], x: torch.Tensor, step: Step) -> torch.Tensor | None:
        """Run the decode ``step`` over ``sublayers`` (consecutive, resident) on ``x`` (token ids [B],
        or hidden states [B, D] when the run does not start at ``embed``), replaying the bucket's graph
        (captured on first use). Returns float32 logits [R, V] for the step's logit rows when the run
        ends at ``head``, else hidden states [B, D] — or None when the step is not covered (run it
        eagerly then). The result is a view of a static buffer: consume it (on the same stream) before
        the next :meth:`run`, since all buckets share one memory pool."""
        why = self.covers(sublayers, step)
        if why is not None:
            self._fall_back(why)
            return None
        names = tuple(s.name for s in sublayers)
        forward = self._forwards.get(names)
        if forward is None:
            forward = self._forwards[names] = StaticDecode(sublayers, self.weights, self.device,
                                                           self.compile_backend)
        batch = batch_bucket(step.num_seqs, self.batch_buckets)
        keys = key_bucket(step.max_context, self.key_buckets)
        caches = [step.kv(a.layer) for a in forward.attention]
        geometry = (caches[0].block_size, caches[0].blocks_per_slot) if caches else None
        # Graphs hold the caches' addresses: a new or moved cache is a new bucket.
        key = (names, batch, keys, tuple((c.k.data_ptr(), c.v.data_ptr(), tuple(c.k.shape)) for c in caches))
        bucket = self._buckets.get(key)
        if bucket is None:
            estimate = capture_bytes(sublayers, batch, keys, x.dtype if x.is_floating_point() else self._dtype(forward))
            if self.capture and not self.fits(estimate):
                self._fall_back("the graph memory limit is reached")  # a capture could pass the budget
                return None
            bucket = self._new_bucket(forward, batch, keys, geometry, x)
            bucket.estimate = estimate
            self._buckets[key] = bucket
        self._buckets.move_to_end(key)
        self._fill(bucket, forward, step, geometry, x)

        def compute():
            return forward(bucket.hidden, bucket.indices.ints, step.kv_lookup, bucket.key_positions)

        if not self.capture:
            bucket.output = compute()
            self.stats.static_eager += 1
        elif bucket.graph is None:
            self._capture(bucket, compute)
            self._evict()
        else:
            bucket.graph.replay()
            self.stats.replays += 1
        out = bucket.output[: step.num_seqs]
        if forward.ends_with_logits and step.logit_rows is not None and step.logit_rows != list(range(step.num_seqs)):
            out = out[torch.tensor(step.logit_rows, dtype=torch.long, device=out.device)]
        return out

    # ------------------------------------------------------------------ internals
    def _new_bucket(self, forward: StaticDecode, batch: int, keys: int, geometry, x: torch.Tensor) -> _Bucket:
        nb = -(-keys // geometry[0]) if geometry else 0
        shape = (batch, _FIXED_COLUMNS + nb)
        pinned = self.device.type == "cuda"
        hidden = None
        if not forward.starts_with_tokens:
            # One input buffer per shape for all runs: each run's input is copied in right before
            # its replay, on the same stream, so runs never need theirs at once (a plan that
            # splits FFNs has some 25 runs, each with several buckets: outside the graph pool,
            # their own buffers would be VRAM the budget did not count).
            key = (batch, x.shape[-1], x.dtype)
            hidden = self._inputs.get(key)
            if hidden is None:
                hidden = self._inputs[key] = torch.zeros(batch, x.shape[-1], dtype=x.dtype, device=self.device)
        indices = self._indices.get((shape, geometry))
        if indices is None:
            indices = self._indices[shape, geometry] = _Indices(
                torch.zeros(shape, dtype=torch.long, device=self.device),
                torch.zeros(shape, dtype=torch.long, pin_memory=pinned))
        return _Bucket(batch, keys, indices, torch.arange(keys, device=self.device), hidden)

    def _fill(self, bucket: _Bucket, forward: StaticDecode, step: Step, geometry, x: torch.Tensor) -> None:
        """The step's indices (and input) into the bucket's static buffers, outside any capture.
        The indices are the same for every run of the step: packed by its first run only (a Step
        is one forward step; another step is another object)."""
        indices = bucket.indices
        tokens = x if forward.starts_with_tokens and x.device.type == "cpu" else None
        if tokens is not None or indices.step is None or indices.step() is not step:
            if indices.copied is not None:
                indices.copied.synchronize()  # the last step's copy out of the staging buffer is done
            pack_decode_inputs(step, geometry, indices.staging, tokens)
            indices.ints.copy_(indices.staging, non_blocking=True)
            if self.device.type == "cuda":
                indices.copied = torch.cuda.Event()
                indices.copied.record()
            indices.step = weakref.ref(step)
        if forward.starts_with_tokens and tokens is None:
            indices.ints[: step.num_seqs, 0].copy_(x, non_blocking=True)
        if not forward.starts_with_tokens:
            bucket.hidden[: step.num_seqs].copy_(x, non_blocking=True)

    def _capture(self, bucket: _Bucket, compute) -> None:
        """Warm up on a side stream, capture into the shared pool, then replay for this step's result.

        The warm-up runs write the step's own keys and values to the step's own positions (the
        buffers hold the real step), so they change nothing the replay does not write again."""
        start = time.perf_counter()
        current = torch.cuda.current_stream(self.device)
        if self._side_stream is None:
            self._side_stream = process_stream(self.device, "graph warm-up")
        if self._pool is None:  # one pool for every bucket: they never replay at the same time
            self._pool = torch.cuda.graph_pool_handle()
        self._side_stream.wait_stream(current)
        with torch.cuda.stream(self._side_stream):
            for _ in range(self.warmup_runs):
                compute()
        current.wait_stream(self._side_stream)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # torch.cuda.graph empties it too: measure from the same point
        before = torch.cuda.memory_reserved(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            bucket.output = compute()
        self._captured(bucket.estimate, max(0, torch.cuda.memory_reserved(self.device) - before))
        bucket.graph = graph
        graph.replay()
        self.stats.captures += 1
        self.stats.capture_seconds += time.perf_counter() - start
        log.info("captured a decode graph: %d sequence(s), %d keys in %.0f ms (graph pool %d MiB)",
                 bucket.batch, bucket.keys, (time.perf_counter() - start) * 1e3, self.pool_bytes >> 20)

    def _dtype(self, forward: StaticDecode) -> torch.dtype:
        """The activation dtype of a run that starts from token ids: its weights' dtype."""
        return next(t.dtype for w in forward.weights for t in w.values() if t.is_floating_point())

    def _evict(self) -> None:
        while len(self._buckets) > self.max_graphs:
            self._buckets.popitem(last=False)
            self.stats.evictions += 1

    def _fall_back(self, why: str) -> None:
        self.stats.fallbacks[why] = self.stats.fallbacks.get(why, 0) + 1
        if why not in self._told:
            self._told.add(why)
            log.info("decode graphs: running a step eagerly: %s", why)
