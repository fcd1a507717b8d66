"""Roofline estimator: the time of every sub-layer on each device, and a simulation of a
whole step over three resources (CPU thread, GPU, copy engine) with the executor's real
dependencies: the Python thread issues GPU work and blocks on CPU sub-layers and on
device crossings; fill k+S of the slot ring is issued after sub-layer k is queued and
waits until the GPU has finished with that slot.

GPU attention over a host KV cache (``Where.kv == "host"``) adds its staging copies on the
copy engine, in the executor's order: the cached prefix host → VRAM before the attention, the
new keys and values VRAM → host after it (the copy engine waits for the attention), and the
Python thread's gather and scatter of those rows in host memory.

A dense FFN split between the CPU and the GPU (``Where.cpu_pieces``) streams only its GPU part;
the Python thread queues that part's kernels (after its slot is filled), computes the CPU part
meanwhile, and the layer's output waits for both and for the activation's crossings (the
normalized input to the other device, its contribution back).

CPU work runs at the profile's contended pace only while the copy engine is busy
(:class:`CopyEngineSpans`): both read host memory, and a copy leaves a matmul less of it.

Decode steps (tiers up to the largest batch bucket) replay each run of GPU-resident sub-layers from a
CUDA graph where the executor does (:mod:`~vramshard.runtime.graphs`): the host then pays one replay a
run (:meth:`Estimator.replay_s`), not each sub-layer's launches; the kernels cost what they cost.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import torch

from ..layers.attention import Attention
from ..layers import cpu_gemv as gemv_kernel  # (as gemv_kernel: Estimator takes a cpu_gemv flag)
from ..layers.mlp import DenseFFN
from ..layers.moe import GATHER_BYTES, MoEFFN
from ..layers.sublayer import SubLayer
from ..models.base import Model
from ..profile.query import DECODE_ROWS, Profile
from ..runtime.graphs import BATCH_BUCKETS, resident_runs
from ..runtime.kv_cache import DEFAULT_BLOCK_SIZE
from ..runtime.kv_staging import DIRECT_RUN_BLOCKS, KV_IN_BUFFERS
from ..runtime.wire_codec import ROUND_RAW_BYTES, wire_ratio
from .mechanisms import (amx_enabled, cpu_gemv_enabled, cpu_packed_enabled, cpu_packed_forced, decode_graphs_enabled,
                         fill_graphs_enabled, run_ahead_bound_enabled, run_ahead_enabled, wire_codec_enabled,
                         zero_copy_enabled)
from .memory import expert_slot_bytes, streamed_bytes, sublayer_packed_bytes
from .placement import Placement

# The profile's dispatch probe (bench_dispatch._tiny_sublayer) makes 10 kernel launches; a launch is
# priced at a fifth of it. Inside a split step the host spends about twice the probe's rate per
# launch (ring fills, events, the aten calls around the kernels: tenth GPU session), and 5 prices
# those steps better. Replayed over the report's 146 measured decode steps (session 24,
# docs/BENCHMARKS.md) 10 fits the eager resident steps (median +58%/+152% -> -20%/+26%) but prices
# the CPU-computing baselines further from their measurements (median |error| 29% -> 37%); the
# host work of split and streamed sub-layers needs its own term, timed on a GPU, before it changes. Since
# session 62 the ring's fills have theirs (Estimator.fill_issue_s); the 5 is still the tenth session's fit.
DISPATCH_LAUNCHES = 5
PART_LAUNCHES = 6  # kernel launches of one part of a split FFN (gate/up, silu, mul, down, add)
AHEAD_LAUNCHES = 5  # more for a part on the run-ahead worker (ready word, wait, submit, its two copies)
GATHER_LAUNCHES = 14  # kernel launches of a few-token MoE step over gathered cache slots, all experts
# Host calls of the expert cache per step of a MoE layer (ExpertSlots): one event marks the
# layer's slots free; each miss waits for its slot's last reader, copies and records the fill on
# the copy stream, and the compute waits for that fill (a cached expert's fill was waited for
# when it came in).
RELEASE_CALLS = 2
COPY_ISSUE_CALLS = 5
# The host's calls to issue one stream-slot fill (SlotRing._copy, _decode) besides its copies, each priced as one
# call of a coded round's issue (Profile.fill_call_s): the fill stream's context, the wait for the slot's last
# reader, the slot's event; a coded pin's decode adds its kernel. A coded range's fill is priced as the profile
# timed the ring's (Profile.fill_issue_s), the calls included.
FILL_CALLS = 3
DECODE_FILL_CALLS = 4
SPLIT_FILL_RANGES = 3  # coded host ranges of a split FFN's GPU part (its gate, up and down rows; its norm raw)
COPY, DECODE = "copy", "decode"  # the engines a stream slot's fill runs on (timeline resources)
# A decode of pinned coded weights into their slot produces raw bytes at this share of the rate a one-row
# bf16 product reads weights on the GPU (the profile's): on the fiftieth session's H100 the Triton decode
# rebuilt a llama3-8b FFN's 352.3 MB in 0.314 ms (1.12 TB/s, benchmarks/wire_codec.py, "decode alone")
# where the H100 profile's [1, 4096] @ [4096, 14336] product reads 2.73 TB/s.
DECODE_SHARE = 0.41
# The executor's host work around one decode-graph replay, in launches (DecodeGraphs.run: the coverage check,
# the step's index arrays packed and copied in one transfer, the replay, the output's view).
REPLAY_CALLS = 4
# Where the profile did not time a graph's replay: a replay costs the host this share of an eager launch, however
# many kernels the graph holds. The fifty-third GPU session's H100 (torch 2.11+cu130) replayed the dispatch
# probe's 10 kernels in 2.73 us of host time, and 1.3 ns more a kernel in a graph of 320, where it launched them
# eagerly at 8.4 us each (under CUDA 12 an H200 had taken 2.2 us a kernel: an earlier session).
GRAPH_REPLAY_SHARE = 0.33


@dataclass
class StepEstimate:
    """Predicted time of one step of a placement, with what kept each resource busy."""

    seconds: float
    cpu_busy: float
    gpu_busy: float
    copy_busy: float
    bytes_streamed: int
    timeline: list[tuple[str, str, float, float]] = field(default_factory=list, repr=False)  # (name, resource, start, end)
    cpu_split_busy: float = 0.0  # of cpu_busy, split dense FFNs' CPU parts on the host thread


class CopyEngineSpans:
    """The copy engine's busy intervals of a simulated step, read from its timeline, for CPU work
    that runs beside them.

    The CPU and the copy engine read the same host memory. While a copy runs, a memory-bound CPU
    matmul gets what the copy leaves of the memory bandwidth (the profile's contended CPU
    table); between copies it runs at its own pace. CPU work is asked for in time order and the
    copy engine runs its queue in order, so one cursor walks the intervals once per step.
    """

    def __init__(self, timeline: list):
        self.timeline = timeline
        self.spans: list[tuple[float, float]] = []
        self._read = 0  # timeline entries read so far
        self._first = 0  # first span that may still end after the next CPU work starts

    def cpu_end(self, start: float, alone_s: float, contended_s: float) -> float:
        """When CPU work that takes ``alone_s`` alone and ``contended_s`` beside copies, started at
        ``start``, ends."""
        if contended_s <= alone_s:
            return start + alone_s
        for entry in self.timeline[self._read:]:
            if entry[1] == "copy" and entry[3] > entry[2]:
                self.spans.append((entry[2], entry[3]))
        self._read = len(self.timeline)
        while self._first < len(self.spans) and self.spans[self._first][1] <= start:
            self._first += 1
        left, now = 1.0, start  # the fraction of the work still to do, and the time
        for begin, end in self.spans[self._first:]:
            if begin > now:  # the copy engine idles until `begin`: the CPU has the memory to itself
                if (begin - now) / alone_s >= left:
                    return now + left * alone_s
                left -= (begin - now) / alone_s
                now = begin
            if (end - now) / contended_s >= left:
                return now + left * contended_s
            left -= (end - now) / contended_s
            now = end
        return now + left * alone_s


def host_pass_s(profile: Profile, moe: MoEFFN, rows: int, contended: bool = False,
                on_worker: bool = False, threads: int | None = None, gemv: bool | None = None) -> float | None:
    """Seconds of the CPU's one pass over a step's routed experts at ``rows`` tokens
    (:mod:`~vramshard.layers.host_experts`) at the profile's measured rate (``on_worker``: its rate
    on the run-ahead worker beside the host thread's Python), slowed as a projection of the experts'
    shape is under PCIe load when ``contended``, and on ``threads`` CPU threads as that projection
    is on them (None: the count the profile timed it at); None where the executor computes them
    otherwise or the profile did not time the pass (then the matmul tables count).

    ``gemv``: whether the executor computes them by the C kernel (None: :func:`cpu_gemv_enabled`).
    A profile made before the kernel took the pass over (no ``host_experts_cpu_gemv``) timed the
    compiled pass; where its one-row tables were timed through the kernel, the kernel's call is priced
    from those tables instead (:func:`_kernel_pass_s`), alone (one torch call: beside the host thread's
    Python as alone)."""
    from ..layers import host_experts  # (the math's own switch and limits)

    dtype = moe.weights[0].dtype
    if not host_experts.ENABLED or dtype not in host_experts.DTYPES or not 1 <= rows <= host_experts.ROWS:
        return None
    if profile.cpu_gemv and not profile.host_experts_cpu_gemv and (cpu_gemv_enabled() if gemv is None else gemv):
        return _kernel_pass_s(profile, moe, rows, contended, threads)
    rate = profile.host_experts_rate(dtype, rows, on_worker)
    if rate is None:
        return None
    seconds = rows * moe.top_k * moe.expert_bytes / rate
    shape = (rows, moe.hidden, 2 * moe.intermediate)
    if contended:
        seconds *= profile.matmul_s(*shape, dtype, "cpu", contended=True) / profile.matmul_s(*shape, dtype, "cpu")
    return seconds * profile.cpu_thread_factor(dtype, threads, *shape)


def _kernel_pass_s(profile: Profile, moe: MoEFFN, rows: int, contended: bool, threads: int | None) -> float:
    """The C kernel's call over ``rows`` tokens' routed experts, from a profile's one-row tables: it
    reads each routed expert once for all its tokens (grouped by expert) and stays bound by that read,
    so it takes the expected distinct experts' one-row gate/up and down products. On the development
    machine (session 36, ``benchmarks.kernel_revisions``) the distinct experts times a one-token call's
    time per expert came 3-5% under the calls measured at 4 and 16 tokens. For Qwen3-30B-A3B at 16
    tokens this prices 12.8 ms on ``h100-run34`` and ``h200-run33``, where their compiled pass's rate
    gave 16.2 and 17.7 ms."""
    dtype = moe.weights[0].dtype
    one = (profile.matmul_s(1, moe.hidden, 2 * moe.intermediate, dtype, "cpu", threads, contended)
           + profile.matmul_s(1, moe.intermediate, moe.hidden, dtype, "cpu", threads, contended))
    if rows > 1 and profile.cpu_rows:  # (the tables are one row's: the engine's fit at these rows instead)
        one *= profile.fitted_row_factor(rows) / profile.fitted_row_factor(1)  # (read-bound: not compute_rows)
    return moe.expected_experts_touched(rows) * one


def _cpu_expert_count(share: float, experts: int) -> int:
    from ..runtime.zero_copy_experts import cpu_expert_count  # (the executor's own rule)

    return cpu_expert_count(share, experts)


# What the zero-copy kernels read of pinned host memory against the copy engine's rate where the
# profile did not measure it (Profile.zero_copy_efficiency): the H200 machine, thirteenth session:
# 50.5 against 55.1 GB/s over 96-384 MiB (benchmarks/zero_copy); the H100 machine read at 61-63%
# (thirty-third session).
ZERO_COPY_EFFICIENCY = 0.92
ZERO_COPY_LAUNCHES = 4  # the kernels, the routing's casts, the sum over a token's experts
# Packed weights must take at most this share of the plain ones' time to be worth their copy: the
# copy costs host memory (a split part's weights again) and seconds to make in a tier's first steps.
PACK_GAIN = 0.95


def zero_copy_efficiency(profile: Profile) -> float:
    """The zero-copy kernels' read rate over the copy engine's: the profile's, else
    :data:`ZERO_COPY_EFFICIENCY`."""
    return profile.zero_copy_efficiency or ZERO_COPY_EFFICIENCY


class Estimator:
    """Costs of one model on one machine (a :class:`Profile`).

    expert_hit_rate: the fraction of routed experts found in the VRAM expert cache (a
    measured rate, or :func:`uniform_hit_rate` of the cache size); MoE sub-layers split at
    their experts copy the rest, at the routed fraction. run_ahead: a MoE layer's host experts, and
    (``run_ahead_dense``; by default as ``run_ahead`` where that is given) a split dense FFN's CPU part on
    a GPU input, are computed by a worker thread (``VRAMSHARD_RUN_AHEAD``), so the host thread's
    launches go on meanwhile; by default as the executor will run. zero_copy: a decode step's
    host-memory experts are read by the GPU from pinned memory (``VRAMSHARD_EXPERTS_ZERO_COPY``),
    on the GPU stream and the PCIe link, with no host round trip; by default as the executor will run.
    graphs: decode steps replay each run of GPU-resident sub-layers from a CUDA graph (the executor's
    ``decode_graphs``); by default as an engine in this process runs (:func:`decode_graphs_enabled`).
    cpu_packed: dense FFNs on the CPU (whole or a split's CPU part) from oneDNN-prepacked weights
    (``VRAMSHARD_CPU_PACKED``), at the profile's :meth:`~Profile.packed_ffn_factor`; by default as
    the executor will run. cpu_gemv: one-row dense FFNs and split parts by the C kernel from the plain
    weights (``VRAMSHARD_CPU_GEMV``), not prepacked: at the profile's tables as they are (its one-row
    products were timed through the same kernel where it served); by default as the executor will run.
    zero_copy_cpu_share: of such a step's host-memory experts, the share the
    CPU computes beside the kernels (the executor's option of that name; the planner leaves it at 0).
    """

    def __init__(self, model: Model, profile: Profile, threads: int | None = None, expert_hit_rate: float = 0.0,
                 sizes: dict[str, int] | None = None, costs: dict | None = None, run_ahead: bool | None = None,
                 zero_copy: bool | None = None, cpu_packed: bool | None = None,
                 zero_copy_cpu_share: float = 0.0, cpu_gemv: bool | None = None,
                 run_ahead_dense: bool | None = None, graphs: bool | None = None, run_ahead_bound: bool | None = None):
        self.model = model
        self.graphs = decode_graphs_enabled() if graphs is None else graphs  # (decode steps replay resident runs)
        self.cpu_packed = cpu_packed_enabled() if cpu_packed is None else cpu_packed
        self.packed_forced = cpu_packed is None and cpu_packed_forced()
        self.cpu_gemv = cpu_gemv_enabled() if cpu_gemv is None else cpu_gemv
        self.gemv_rows = gemv_kernel.FFN_ROWS if self.cpu_gemv else 0  # (the most rows of dense FFN work it takes)
        # bf16 FFN work of more rows through its matrix tiles (VRAMSHARD_CPU_AMX)
        self.amx = self.cpu_gemv and model.dtype == torch.bfloat16 and amx_enabled()
        # Host experts, and split FFNs' CPU parts, on the executor's run-ahead worker (None: as the executor will run).
        self.run_ahead = run_ahead_enabled() if run_ahead is None else run_ahead
        as_executor = run_ahead is None and run_ahead_dense is None
        if run_ahead_dense is None:
            run_ahead_dense = run_ahead_enabled(dense=True) if run_ahead is None else run_ahead
        self.run_ahead_dense = run_ahead_dense
        # ... or of them those that run as one bound C call (by default as the executor will, or as run_ahead_dense)
        if run_ahead_bound is None:
            run_ahead_bound = run_ahead_bound_enabled() if as_executor else run_ahead_dense
        self.run_ahead_bound = run_ahead_bound
        available, self.zero_copy_rows = zero_copy_enabled()
        self.zero_copy = available if zero_copy is None else zero_copy  # (host experts read by the GPU)
        self.zero_copy_efficiency = zero_copy_efficiency(profile)  # (of the copy engine's rate)
        self.zero_copy_cpu_share = zero_copy_cpu_share  # (of their host experts, computed by the CPU)
        self.sizes = sizes if sizes is not None else {}  # packed bytes by sub-layer name, filled lazily
        self.wire_ratio = wire_ratio(model.dtype, wire_codec_enabled())  # link bytes a stream fill moves per byte
        self.fill_graphs = fill_graphs_enabled()  # (coded fills: the host's issue of each)
        self.profile = profile
        self.threads = threads
        self.dtype = model.dtype
        self.expert_hit_rate = expert_hit_rate
        self._expert_slot = expert_slot_bytes(model)
        # Costs of sub-layers and parts (keys hold the thread count; nothing here depends on the hit
        # rate), shareable by estimators of one model and profile that differ in their hit rate.
        self._cache: dict = costs if costs is not None else {}
        self._dispatch: dict[str, float] = {}  # device -> dispatch seconds (a profile constant)
        self._crossings: dict[tuple, float] = {}  # (bytes, direction) -> seconds
        # (tokens, context, streams) -> {sub-layer on the CPU, (split FFN, CPU pieces), (sub-layer, "cuda"):
        # its costs in a step}: what :meth:`_simulate_steps` reads per sub-layer, looked up once per step
        # size (a plan simulates thousands of steps of a few sizes; this took a quarter off its time).
        self._step_costs: dict[tuple, dict] = {}

    def packs_at(self, rows: int) -> bool:
        """Whether dense FFNs on the CPU read prepacked weights at ``rows`` rows, as planned: where the
        executor packs (decode-sized steps only, ``cpu_packed.DECODE_ROWS``: prompt chunks compute
        plain parts; not at the few rows the C kernel computes from the plain ones), and the
        profile finds packed weights at least PACK_GAIN faster there. On the H100 and H200 hosts
        bf16 FFNs took 1.04-1.15x as long packed as plain at 16 and 64 rows
        (docs/profiles/h100-run34.json, h200-run33.json), and packing them in the first steps of a
        tier stalled those steps 2.2-3.6 s (docs/BENCHMARKS.md, thirty-first GPU session).
        ``VRAMSHARD_CPU_PACKED=on`` packs at every such tier, whatever the profile says."""
        return (self.cpu_packed and rows <= DECODE_ROWS and rows > self.gemv_rows and not self.tiles_at(rows)
                and (self.packed_forced or self.profile.packed_ffn_factor(self.dtype, rows) < PACK_GAIN))

    def tiles_at(self, rows: int) -> bool:
        """Whether dense FFN work of ``rows`` rows on the CPU goes through the C kernel's matrix tiles (as the
        executor computes it: :func:`~vramshard.layers.cpu_gemv.amx_computes`), priced at the profile's
        :meth:`~Profile.tiles_ffn_factor` of torch's time (1 where the profile did not measure it)."""
        return self.amx and self.gemv_rows < rows <= gemv_kernel.AMX_ROWS

    # ------------------------------------------------------------------ one sub-layer
    def logit_rows(self, n_tokens: int) -> int:
        """Rows the head computes: one per decoded sequence, one per prompt chunk when prefilling."""
        return n_tokens if n_tokens <= 64 else 1

    def compute_s(self, sublayer: SubLayer, device: str, n_tokens: int, context: int,
                  contended: bool = False) -> float:
        """Kernel time of one sub-layer (``device`` "cpu" or "cuda"), launch overhead excluded."""
        key = (sublayer.name, device, n_tokens, context, contended, self.threads, self.cpu_packed, self.cpu_gemv,
               self.amx)
        if key in self._cache:
            return self._cache[key]
        rows = self.logit_rows(n_tokens) if sublayer.kind == "head" else n_tokens
        if device == "cpu" and isinstance(sublayer, DenseFFN):
            rows = self._ffn_rows(rows)
        seconds = 0.0
        for (m, k, n), count in Counter(sublayer.matmuls(rows)).items():  # MoE: many identical experts
            seconds += count * self._matmul(m, k, n, device, contended)
        if device == "cpu" and self.packs_at(n_tokens) and isinstance(sublayer, DenseFFN):
            seconds *= self.profile.packed_ffn_factor(self.dtype, n_tokens)
        elif device == "cpu" and self.tiles_at(n_tokens) and isinstance(sublayer, DenseFFN):
            seconds *= self.profile.tiles_ffn_factor(self.dtype, n_tokens)
        passed = host_pass_s(self.profile, sublayer, n_tokens, contended, threads=self.threads, gemv=self.cpu_gemv) \
            if device == "cpu" and isinstance(sublayer, MoEFFN) else None
        if passed is not None:  # its experts in the compiled pass
            seconds = passed + sum(self._matmul(m, k, n, device, contended) for m, k, n in sublayer.main_matmuls(rows))
        if isinstance(sublayer, Attention):
            seconds += self.attention_s(sublayer, device, n_tokens, context)
        if sublayer.kind == "embed":
            row = sublayer.weights[0].nbytes // sublayer.weights[0].shape[0]
            seconds += n_tokens * row / 5e9
        self._cache[key] = seconds
        return seconds

    def attention_s(self, sublayer: Attention, device: str, n_tokens: int, context: int) -> float:
        """Attention of ``n_tokens`` new tokens over ``context`` cached positions (its projections apart). On the
        CPU a decode tier of several sequences attends sequence by sequence through the C kernel where it serves the
        dtype (each sequence's one token over its share of the context: the profile's one-token attention, which
        the kernel computed); elsewhere it gathers their cached keys and values into one padded batch first (the
        profile times attention over contiguous keys)."""
        heads, kv_heads, dim = sublayer.num_heads, sublayer.num_kv_heads, sublayer.head_dim
        threads = self.threads if device == "cpu" else None
        if device == "cpu" and 1 < n_tokens <= 64:
            if self.cpu_gemv and self.dtype in gemv_kernel.DTYPES and heads // kv_heads <= gemv_kernel.MAX_GROUP:
                share = max(1, context // n_tokens)
                return n_tokens * self.profile.attention_s(1, share, heads, kv_heads, dim, self.dtype, device,
                                                           threads=threads)
            return (self.profile.attention_s(n_tokens, context, heads, kv_heads, dim, self.dtype, device,
                                             threads=threads)
                    + self.profile.host_gather_s(context * sublayer.kv_bytes_per_token(self.dtype)))
        return self.profile.attention_s(n_tokens, context, heads, kv_heads, dim, self.dtype, device, threads=threads)

    def _ffn_rows(self, rows: int) -> int:
        """The rows to price a dense FFN's CPU products of ``rows`` rows at: one where the C kernel computes
        them and the profile's one-row tables went through it. It reads each weight row once for all the
        rows of x, so a few rows cost the weights' read, as one does: at four rows it read an 8B FFN at 0.93-0.96x
        its one-row rate in bf16 and 0.92-0.93x in fp16 on the development machine (session 36,
        ``benchmarks.cpu_gemv`` and ``benchmarks.kernel_revisions``); the profile's tables of more rows time
        torch's paths."""
        return 1 if 1 < rows <= self.gemv_rows and self.profile.cpu_gemv else rows

    def _bound_part(self, rows: int) -> bool:
        """Whether a split FFN's CPU part of ``rows`` rows runs as one bound C call (the run-ahead worker's, where
        ``run_ahead_bound``): the C kernel computes it, in bf16 or fp16, or through its matrix tiles."""
        return (self.cpu_gemv and 1 <= rows <= self.gemv_rows and self.dtype in (torch.bfloat16, torch.float16)
                or self.tiles_at(rows))

    def _matmul(self, m: float, k: int, n: int, device: str, contended: bool) -> float:
        if m <= 0:
            return 0.0
        whole = max(1, int(m))
        t = self.profile.matmul_s(whole, k, n, self.dtype, device,
                                  threads=self.threads if device == "cpu" else None,
                                  contended=contended and device == "cpu")
        return t * (m / whole) if m < 1 else t

    def dispatch_s(self, device: str) -> float:
        """The profile's dispatch cost on ``device`` (read once: the planner asks for it very often)."""
        seconds = self._dispatch.get(device)
        if seconds is None:
            seconds = self._dispatch[device] = self.profile.dispatch_s(device)
        return seconds

    def replay_s(self, kernels: int) -> float:
        """The host's seconds to replay a decode graph of ``kernels`` kernels, with the executor's work around
        it (:data:`REPLAY_CALLS`): as the profile timed a replay, else :data:`GRAPH_REPLAY_SHARE` of an
        eager launch."""
        launch = self.dispatch_s("cuda") / DISPATCH_LAUNCHES
        replay = self.profile.graph_replay_s(kernels)
        if replay is None:
            replay = GRAPH_REPLAY_SHARE * launch
        return REPLAY_CALLS * launch + replay

    def replayed_launches(self, placement: Placement, n_tokens: int) -> dict[str, float]:
        """{sub-layer: the host's launch seconds} of the sub-layers a decode step of ``n_tokens`` sequences
        replays from CUDA graphs under ``placement``: the whole run's replay on its first sub-layer, 0 on
        the others (empty: no graphs, or not a decode step the executor's graphs cover)."""
        if not self.graphs or n_tokens > BATCH_BUCKETS[-1]:
            return {}
        sublayers = [s for s in self.model if s.kind != "vision"]
        replayed = {}
        for begin, end in resident_runs(placement, sublayers):
            run = sublayers[begin:end]
            replayed.update((s.name, 0.0) for s in run)
            replayed[run[0].name] = self.replay_s(sum(s.launches for s in run))
        return replayed

    def launch_s(self, sublayer: SubLayer, device: str, n_tokens: int) -> float:
        """Python + launch overhead of one sub-layer's forward."""
        key = ("launch", sublayer.name, device, n_tokens)
        seconds = self._cache.get(key)
        if seconds is None:
            launches = sublayer.launches
            if sublayer.kind == "ffn" and hasattr(sublayer, "expected_experts_touched"):
                launches += 8 * round(sublayer.expected_experts_touched(n_tokens))
            seconds = self._cache[key] = self.dispatch_s(device) * launches / DISPATCH_LAUNCHES
        return seconds

    def packed_bytes(self, name: str) -> int:
        if name not in self.sizes:
            self.sizes[name] = sublayer_packed_bytes(self.model, name)
        return self.sizes[name]

    def decode_s(self, sublayer: SubLayer) -> float:
        """One decode of ``sublayer`` pinned coded into its stream slot (:mod:`~vramshard.runtime.vram_coded`)."""
        key = ("decode", sublayer.name)
        seconds = self._cache.get(key)
        if seconds is None:
            seconds = self._cache[key] = self.packed_bytes(sublayer.name) / vram_decode_bps(self.profile)
        return seconds

    def copy_s(self, sublayer: SubLayer, contended: bool = False) -> float:
        return self.profile.transfer_s(round(self.packed_bytes(sublayer.name) * self.wire_ratio), "h2d", contended)

    # ------------------------------------------------------------------ dense FFN split CPU / GPU
    def fill_bytes(self, sublayer: SubLayer, where) -> int:
        """Bytes one stream-slot fill of ``sublayer`` placed at ``where`` copies (a split: its GPU part)."""
        if not where.split:
            return self.packed_bytes(sublayer.name)
        key = ("fill", sublayer.name, where.cpu_pieces)
        if key not in self._cache:
            self._cache[key] = streamed_bytes(self.model, sublayer.name, where)
        return self._cache[key]

    def part_s(self, sublayer: DenseFFN, device: str, n_tokens: int, first: int, last: int,
               contended: bool = False) -> float:
        """Time of pieces ``[first, last)`` of a dense FFN on ``device``, launches included (the CPU
        part also counts the norm and the residual add)."""
        key = ("part", sublayer.name, device, n_tokens, first, last, contended, self.threads, self.cpu_packed,
               self.cpu_gemv, self.amx)
        if key not in self._cache:
            rows = self._ffn_rows(n_tokens) if device == "cpu" else n_tokens
            kernels = sum(self._matmul(m, k, n, device, contended) for m, k, n in
                          sublayer.part_matmuls(rows, first, last))
            if device == "cpu" and self.packs_at(n_tokens):
                kernels *= self.profile.packed_ffn_factor(self.dtype, n_tokens)  # packed once: no slices
                if last - first < sublayer.num_pieces:
                    kernels *= self.profile.split_part_scale  # as the engine fitted split parts in situ
            elif device == "cpu":
                if self.tiles_at(n_tokens):
                    kernels *= self.profile.tiles_ffn_factor(self.dtype, n_tokens)  # (down from its row-major copy)
                if last - first < sublayer.num_pieces:
                    kernels *= self.profile.split_part_factor(self.dtype)  # sliced weights read slower
            if device == "cpu" and last - first < sublayer.num_pieces:
                kernels *= self.profile.split_row_factor(n_tokens)  # as the engine fitted split parts by rows
            launches = PART_LAUNCHES + (3 if device == "cpu" else 0)
            self._cache[key] = kernels + self.dispatch_s(device) * launches / DISPATCH_LAUNCHES
        return self._cache[key]

    # ------------------------------------------------------------------ MoE split at its experts
    def router_s(self, sublayer: MoEFFN, n_tokens: int) -> float:
        """GPU time of the main piece (norm, router, shared expert), launches included."""
        key = ("router", sublayer.hidden, sublayer.num_experts, sublayer.shared_intermediate, n_tokens)
        if key not in self._cache:
            kernels = sum(self._matmul(m, k, n, "cuda", False) for m, k, n in sublayer.main_matmuls(n_tokens))
            launches = 6 + (6 if sublayer.shared_intermediate else 0)
            self._cache[key] = kernels + self.dispatch_s("cuda") * launches / DISPATCH_LAUNCHES
        return self._cache[key]

    def experts_s(self, sublayer: MoEFFN, device: str, n_tokens: int, contended: bool = False,
                  launches: bool = True, on_worker: bool = False) -> float:
        """Time of the routed experts alone (the hit ones, grouped), with the grouped path's
        launches (a few per expert touched) unless ``launches`` is False: the kernels alone.
        ``on_worker``: on the CPU, computed by the run-ahead worker (:func:`host_pass_s`)."""
        key = ("experts", sublayer.hidden, sublayer.intermediate, sublayer.num_experts, sublayer.top_k, device,
               n_tokens, contended, self.threads)
        if key not in self._cache:
            self._cache[key] = sum(count * self._matmul(m, k, n, device, contended)
                                   for (m, k, n), count in Counter(sublayer.expert_matmuls(n_tokens)).items())
        passed = None
        if device == "cpu":
            pass_key = ("host pass", *key[1:5], n_tokens, contended, on_worker, self.threads, self.cpu_gemv)
            if pass_key not in self._cache:
                self._cache[pass_key] = host_pass_s(self.profile, sublayer, n_tokens, contended, on_worker,
                                                    self.threads, self.cpu_gemv)
            passed = self._cache[pass_key]
        if passed is not None:  # a few tokens on the CPU in the compiled pass, its call's costs included
            return passed
        kernels = self._cache[key]
        if not launches:
            return kernels
        count = 8 + 8 * round(sublayer.expected_experts_touched(n_tokens))
        return kernels + self.dispatch_s(device) * count / DISPATCH_LAUNCHES

    def expert_miss_bytes(self, sublayer: MoEFFN, n_tokens: int) -> float:
        """Expected bytes the expert cache copies for one step: routed experts it lacks."""
        touched = sublayer.expected_experts_touched(n_tokens)
        return touched * (1 - self.expert_hit_rate) * self._expert_slot

    def staging_bytes(self, sublayer: Attention, n_tokens: int, context: int) -> tuple[int, int]:
        """(prefix bytes copied host → VRAM, new bytes copied VRAM → host) of one step of GPU attention
        over a host KV cache: the step's ``n_tokens`` end at ``context``, so ``context - n_tokens``
        positions were cached before it (0 for a first chunk)."""
        per_token = sublayer.kv_bytes_per_token(self.dtype)
        return max(0, context - n_tokens) * per_token, n_tokens * per_token

    def crossing_s(self, nbytes: int, direction: str) -> float:
        """Moving activations between devices: a small copy plus a synchronisation."""
        key = (nbytes, direction)
        seconds = self._crossings.get(key)
        if seconds is None:
            seconds = self._crossings[key] = self.profile.transfer_s(nbytes, direction) + self.dispatch_s("cuda")
        return seconds

    # ------------------------------------------------------------------ one step
    def simulate(self, placement: Placement, n_tokens: int, context: int, num_slots: int = 2) -> StepEstimate:
        """Predicted steady-state time of one step (the ring already primed by the step before)."""
        where = placement.as_dict()
        streams = bool(placement.names(home="stream") or placement.expert_names("cache"))
        cpu_work = bool(placement.names(compute="cpu") or placement.expert_names("host") or placement.split_names())
        # A token step does not run the vision encoder: a language model's plan does not place it.
        # The ring's order: streamed sub-layers (filled by the copy engine) and those pinned coded (decoded).
        order = [s for s in self.model
                 if s.kind != "vision" and (where[s.name].home == "stream" or where[s.name].coded)]
        decode_issue = self.profile.fill_call_s() * DECODE_FILL_CALLS if placement.coded_names() else 0.0
        fills = [(0, self.decode_s(s), DECODE, decode_issue) if where[s.name].coded
                 else self._fill(s, where[s.name], cpu_work) for s in order]  # (bytes over the link, seconds, engine, the host's seconds to issue it) of each
        replayed = self.replayed_launches(placement, n_tokens)
        # Simulate two consecutive steps; the second is the steady state.
        est = self._simulate_steps(where, order, fills, n_tokens, context, num_slots, streams, cpu_work, steps=2,
                                   replayed=replayed)
        est.bytes_streamed = int(sum(nbytes for nbytes, *_ in fills)
                                 + sum(self.expert_miss_bytes(self.model[n], n_tokens)
                                       for n in placement.expert_names("cache")))
        return est

    def _fill(self, sublayer: SubLayer, where, cpu_work: bool) -> tuple[int, float, str, float]:
        """(bytes, copy seconds, COPY, the host's seconds to issue it) of one stream-slot fill of ``sublayer``
        placed at ``where``, the copy beside CPU work where ``cpu_work``."""
        key = ("fill_s", sublayer.name, where.cpu_pieces if where.split else None, cpu_work)
        fill = self._cache.get(key)
        if fill is None:
            nbytes = round(self.fill_bytes(sublayer, where) * self.wire_ratio)  # (over the link)
            fill = self._cache[key] = (nbytes, self.profile.transfer_s(nbytes, "h2d", cpu_work), COPY,
                                       self.fill_issue_s(sublayer, where))
        return fill

    def fill_issue_s(self, sublayer: SubLayer, where) -> float:
        """The host's seconds to issue one stream-slot fill of ``sublayer`` placed at ``where``: a copy a host
        range raw, or each coded range (a split's gate, up and down rows) as the profile timed a coded fill of its
        rounds, replayed from its CUDA graph or round by round (:attr:`fill_graphs`). The thread that issues
        fills also queues the GPU's work and computes the CPU's (fifty-fifth GPU session: ~0.28 ms a coded range's
        fill under cProfile inside a planned llama3-8b decode step, unpriced before)."""
        call = self.profile.fill_call_s()
        ranges = SPLIT_FILL_RANGES + 1 if where.split else 1
        if self.wire_ratio >= 1:
            return call * (FILL_CALLS + ranges)
        coded = SPLIT_FILL_RANGES if where.split else 1
        rounds = math.ceil(self.fill_bytes(sublayer, where) / coded / ROUND_RAW_BYTES)
        return coded * self.profile.fill_issue_s(rounds, self.fill_graphs) + (ranges - coded) * call

    def _cpu_costs(self, costs: dict, sublayer: SubLayer, n_tokens: int, context: int,
                   streams: bool) -> tuple[float, float, float]:
        """(alone, beside copies, launches) seconds of ``sublayer`` on the CPU, kept in ``costs``."""
        alone = self.compute_s(sublayer, "cpu", n_tokens, context)
        beside = self.compute_s(sublayer, "cpu", n_tokens, context, contended=True) if streams else alone
        costs[sublayer.name] = cost = (alone, beside, self.launch_s(sublayer, "cpu", n_tokens))
        return cost

    def _split_costs(self, costs: dict, sublayer: DenseFFN, cpu_pieces: int, n_tokens: int,
                     streams: bool) -> tuple[float, float, float]:
        """(GPU part, CPU part alone, CPU part beside copies) seconds of a split FFN, kept in ``costs``."""
        pieces = sublayer.num_pieces
        cpu_alone = self.part_s(sublayer, "cpu", n_tokens, 0, cpu_pieces)
        cpu_beside = self.part_s(sublayer, "cpu", n_tokens, 0, cpu_pieces, contended=True) if streams else cpu_alone
        costs[sublayer.name, cpu_pieces] = cost = (self.part_s(sublayer, "cuda", n_tokens, cpu_pieces, pieces),
                                                   cpu_alone, cpu_beside)
        return cost

    def _simulate_steps(self, where, order, fills, n_tokens, context, num_slots, streams, cpu_work,
                        steps, replayed=None) -> StepEstimate:
        """The last of ``steps`` consecutive steps: its time and busy times, the timeline of all.
        ``fills``: (bytes, seconds, engine) of each fill of the ring's ``order``: the copy engine's, or a
        decode of a sub-layer pinned coded on the executor's decode stream. ``replayed``: the host's launch
        seconds of sub-layers replayed from CUDA graphs (:meth:`replayed_launches`)."""
        replayed = replayed or {}
        costs = self._step_costs.get((n_tokens, context, streams))
        if costs is None:
            costs = self._step_costs[n_tokens, context, streams] = {}
        py = 0.0  # the Python thread (it also does the CPU compute)
        gpu_free = 0.0
        copy_free = 0.0
        decode_free = 0.0  # the decode stream (sub-layers pinned coded into their slots)
        cpu_busy = gpu_busy = copy_busy = split_busy = 0.0
        timeline = []
        copies = CopyEngineSpans(timeline)
        n_stream = len(order)
        fill_done: dict[int, float] = {}  # global fill index -> time the slot holds its weights
        slot_released: dict[int, float] = {}  # global use index -> GPU time the slot became free
        fills_issued = 0
        written_back = 0.0  # when the last KV write-back of a staged attention is done
        kv_in_read: list[float] = []  # when each staged attention's copy in has read its pinned buffer
        worker_free = 0.0  # the run-ahead worker (split FFNs' CPU parts), when it is on
        parts_back: list[float] = []  # when each run-ahead part's result is on the GPU

        def buffer_free(at: float) -> float:
            """When the host can hand out a run-ahead part's result buffer: the copy of the part
            before last has read it."""
            return max(at, parts_back[-2]) if len(parts_back) >= 2 else at

        def on_worker(name: str, landed: float, stream_at: float, alone: float, beside: float) -> float:
            """A part on the run-ahead worker whose input is on the host at ``landed``, its result
            copied in once the stream is at ``stream_at`` too: when that result is on the GPU."""
            nonlocal worker_free, cpu_busy
            begin = max(worker_free, landed)
            worker_free = copies.cpu_end(begin, alone, beside)
            cpu_busy += worker_free - begin
            timeline.append((name, "cpu", begin, worker_free))
            parts_back.append(max(stream_at, worker_free) + self.profile.transfer_s(act_bytes, "h2d"))
            return parts_back[-1]

        def experts_on_worker(name: str, router_done: float, alone: float, beside: float) -> float:
            """A MoE layer's host experts (or the CPU's share of them) handed to the run-ahead
            worker: the host queues the hand-over and goes on; when the result is on the GPU."""
            nonlocal py
            py = buffer_free(py) + self.dispatch_s("cuda") * AHEAD_LAUNCHES / DISPATCH_LAUNCHES
            landed = router_done + self.profile.transfer_s(act_bytes, "d2h")
            return on_worker(name, landed, router_done, alone, beside)

        def issue_fill(at: float) -> float:
            """The ring's next fill, its issue begun by the host at ``at``: the host's seconds to issue it."""
            nonlocal fills_issued, copy_free, copy_busy, decode_free, gpu_free, gpu_busy
            index = fills_issued
            sublayer = order[index % n_stream]
            previous_user = index - num_slots
            free_at = slot_released.get(previous_user, 0.0) if previous_user >= 0 else 0.0
            _, seconds, engine, host = fills[index % n_stream]
            at += host  # (the copies and decodes begin once issued)
            if engine == DECODE:
                # A decode reads and writes VRAM as the compute kernels read it: on a stream of its own, it shares
                # the GPU's memory with them, so the GPU's time is theirs and its together.
                start = max(at, decode_free, free_at, gpu_free)
                decode_free = fill_done[index] = gpu_free = start + seconds
                gpu_busy += seconds
            else:
                start = max(at, copy_free, free_at)
                copy_free = fill_done[index] = start + seconds
                copy_busy += seconds
            timeline.append((sublayer.name, engine, start, fill_done[index]))
            fills_issued += 1
            return host

        if n_stream:
            for _ in range(min(num_slots, n_stream)):
                py += issue_fill(py)
        uses = 0
        x_device, x_ready = "cpu", 0.0
        act_bytes = n_tokens * self.model.args.hidden_size * self.dtype.itemsize
        logit_bytes = self.logit_rows(n_tokens) * self.model.args.vocab_size * 4
        last_start = (0.0, 0.0, 0.0, 0.0)  # (time, cpu, gpu, copy busy) when the last step began
        for _ in range(steps):
            last_start = (py, cpu_busy, gpu_busy, copy_busy)
            split0 = split_busy
            for sublayer in self.model:
                if sublayer.kind == "vision":
                    continue  # a token step does not run the vision encoder
                w = where[sublayer.name]
                if w.compute == "cpu":
                    if x_device == "cuda":
                        py = max(py, x_ready) + self.crossing_s(act_bytes, "d2h")
                        x_device = "cpu"
                    start = max(py, x_ready)
                    alone, beside, launch = costs.get(sublayer.name) \
                        or self._cpu_costs(costs, sublayer, n_tokens, context, streams)
                    seconds = copies.cpu_end(start, alone, beside) - start + launch
                    py = x_ready = start + seconds
                    cpu_busy += seconds
                    timeline.append((sublayer.name, "cpu", start, py))
                    continue
                if w.split:
                    # GPU part queued on its slot, CPU part meanwhile, the output where the input is.
                    k = w.cpu_pieces
                    gpu_s, cpu_alone, cpu_beside = costs.get((sublayer.name, k)) \
                        or self._split_costs(costs, sublayer, k, n_tokens, streams)
                    launch = self.dispatch_s("cuda") * PART_LAUNCHES / DISPATCH_LAUNCHES
                    if x_device == "cpu":
                        py = max(py, x_ready) + self.crossing_s(act_bytes, "h2d")  # h to the GPU
                        h_ready = py
                    else:  # the norm on the GPU (negligible), from the GPU part's slot: after its fill
                        h_ready = max(gpu_free, x_ready, fill_done[uses])
                    ahead = x_device == "cuda" and (self.run_ahead_dense or self.run_ahead_bound
                                                    and self._bound_part(n_tokens))
                    if ahead:
                        launch += self.dispatch_s("cuda") * AHEAD_LAUNCHES / DISPATCH_LAUNCHES
                        py = buffer_free(py)
                    start = max(gpu_free, h_ready, fill_done[uses], py)
                    py += launch
                    gpu_done = max(start + gpu_s, py)
                    gpu_busy += gpu_s
                    gpu_free = gpu_done
                    timeline.append((sublayer.name, "gpu", start, gpu_done))
                    slot_released[uses] = gpu_done
                    uses += 1
                    py += issue_fill(py)
                    if ahead:  # the worker computes once h has landed; the GPU adds its part after both
                        landed = h_ready + self.profile.transfer_s(act_bytes, "d2h")
                        gpu_free = x_ready = on_worker(sublayer.name, landed, gpu_done, cpu_alone, cpu_beside)
                        continue
                    if x_device == "cuda":
                        py = max(py, h_ready) + self.crossing_s(act_bytes, "d2h")  # h to the host
                    cpu_s = copies.cpu_end(py, cpu_alone, cpu_beside) - py
                    timeline.append((sublayer.name, "cpu", py, py + cpu_s))
                    py += cpu_s
                    cpu_busy += cpu_s
                    split_busy += cpu_s
                    if x_device == "cpu":  # the GPU's contribution comes back
                        py = max(py, gpu_done) + self.crossing_s(act_bytes, "d2h")
                        x_ready = py
                    else:  # the CPU's contribution goes to the GPU
                        py += self.crossing_s(act_bytes, "h2d")
                        gpu_free = x_ready = max(gpu_done, py)
                    continue
                if x_device == "cpu":
                    if sublayer.kind != "embed":
                        py = max(py, x_ready) + self.crossing_s(act_bytes, "h2d")
                    x_ready = max(x_ready, py)
                    x_device = "cuda"
                if w.home == "experts":
                    # Norm and router on the GPU; the grouped experts need the routing on the host.
                    start = max(gpu_free, x_ready, py)
                    router_done = start + self.router_s(sublayer, n_tokens)
                    gpu_busy += router_done - start
                    if self.zero_copy and n_tokens <= self.zero_copy_rows:
                        # Read by the GPU's kernels, the misses over the link after the copies queued
                        # before; cached hits from their VRAM slots (no copy, no host round trip).
                        read = n_tokens * sublayer.top_k * sublayer.expert_bytes
                        hits = 0.0
                        if w.experts == "cache":
                            read = self.expert_miss_bytes(sublayer, n_tokens)
                            hits = self.experts_s(sublayer, "cuda", n_tokens, launches=False) * self.expert_hit_rate
                        elif self.zero_copy_cpu_share:
                            # Each token's first experts go to the CPU: the host queues the kernels over
                            # the rest without waiting, then waits for the router and computes its own
                            # meanwhile; its sum comes back to be added.
                            on_cpu = _cpu_expert_count(self.zero_copy_cpu_share, sublayer.top_k) / sublayer.top_k
                            py += self.dispatch_s("cuda") * ZERO_COPY_LAUNCHES / DISPATCH_LAUNCHES
                            start = max(py, router_done, copy_free)
                            copy_free = start + self.profile.transfer_s(read * (1 - on_cpu), "h2d", True) \
                                / self.zero_copy_efficiency
                            copy_busy += copy_free - start
                            gpu_busy += copy_free - start
                            timeline.append((sublayer.name, "copy", start, copy_free))
                            # With run-ahead the CPU's share is the worker's, at the pass's rate there
                            # (priced at the rate alone, the twenty-third GPU session's engine at share
                            # 0.556 was predicted at 22.9 tok/s and decoded at 15.3), and the host goes on.
                            ahead = self.run_ahead
                            alone = self.experts_s(sublayer, "cpu", n_tokens, on_worker=ahead) * on_cpu
                            beside = self.experts_s(sublayer, "cpu", n_tokens, contended=True, on_worker=ahead) * on_cpu
                            if ahead:
                                back = experts_on_worker(sublayer.name, router_done, alone, beside)
                                gpu_free = x_ready = max(copy_free, back)
                                continue
                            py = max(py, router_done) + self.crossing_s(act_bytes, "d2h")
                            seconds = copies.cpu_end(py, alone, beside) - py
                            timeline.append((sublayer.name, "cpu", py, py + seconds))
                            cpu_busy += seconds
                            py += seconds + self.crossing_s(act_bytes, "h2d")
                            gpu_free = x_ready = max(copy_free, py)
                            continue
                        start = max(router_done + hits, copy_free)
                        copy_free = start + self.profile.transfer_s(read, "h2d", cpu_work) / self.zero_copy_efficiency
                        copy_busy += copy_free - start
                        gpu_busy += copy_free - start
                        timeline.append((sublayer.name, "copy", start, copy_free))
                        py += self.dispatch_s("cuda") * ZERO_COPY_LAUNCHES / DISPATCH_LAUNCHES
                        gpu_free = x_ready = max(copy_free, py)
                        continue
                    if w.experts == "host":
                        ahead = self.run_ahead  # on the worker, at the pass's rate there
                        alone = self.experts_s(sublayer, "cpu", n_tokens, on_worker=ahead)
                        beside = self.experts_s(sublayer, "cpu", n_tokens, contended=True, on_worker=ahead) \
                            if streams else alone
                    if w.experts == "host" and self.run_ahead:  # on the worker: the host does not wait
                        gpu_free = x_ready = experts_on_worker(sublayer.name, router_done, alone, beside)
                        continue
                    py = max(py, router_done)
                    if w.experts == "host":
                        py += self.crossing_s(act_bytes, "d2h")
                        seconds = copies.cpu_end(py, alone, beside) - py
                        timeline.append((sublayer.name, "cpu", py, py + seconds))
                        cpu_busy += seconds
                        py += seconds + self.crossing_s(act_bytes, "h2d")
                        gpu_free = x_ready = py
                    else:
                        miss = self.expert_miss_bytes(sublayer, n_tokens)
                        copy_start = max(copy_free, py)
                        copy_free = copy_start + self.profile.transfer_s(miss, "h2d", cpu_work) if miss else copy_start
                        copy_busy += copy_free - copy_start
                        timeline.append((sublayer.name, "copy", copy_start, copy_free))
                        touched = max(1.0, sublayer.expected_experts_touched(n_tokens))
                        if n_tokens * sublayer.top_k * sublayer.expert_bytes <= GATHER_BYTES:
                            # All experts at once from the cache's slots, after the last copy: a few
                            # launches for the layer (counted on the host), not a few per expert;
                            # the host also frees the slots and issues each miss's copy.
                            kernels = self.experts_s(sublayer, "cuda", n_tokens, launches=False)
                            misses = touched * (1.0 - self.expert_hit_rate)
                            calls = GATHER_LAUNCHES + RELEASE_CALLS + COPY_ISSUE_CALLS * misses
                            py += self.dispatch_s("cuda") * calls / DISPATCH_LAUNCHES
                            gpu_free = max(router_done, copy_free, py) + kernels
                        else:
                            kernels = self.experts_s(sublayer, "cuda", n_tokens)
                            py += self.dispatch_s("cuda") * 8 * touched / DISPATCH_LAUNCHES
                            # Cached experts compute while the others arrive; the last one after its copy.
                            gpu_free = max(router_done + kernels, copy_free + kernels / touched, py)
                        gpu_busy += kernels
                        timeline.append((sublayer.name, "gpu", router_done, gpu_free))
                        x_ready = gpu_free
                    continue
                gpu = costs.get((sublayer.name, "cuda"))
                if gpu is None:
                    gpu = costs[sublayer.name, "cuda"] = (self.launch_s(sublayer, "cuda", n_tokens),
                                                          self.compute_s(sublayer, "cuda", n_tokens, context))
                launch, kernels = gpu
                launch = replayed.get(sublayer.name, launch)
                ready = x_ready
                if w.home == "stream" or w.coded:
                    ready = max(ready, fill_done[uses])
                if w.stages_kv:
                    prefix, new = self.staging_bytes(sublayer, n_tokens, context)
                    sequences = n_tokens if n_tokens <= DECODE_ROWS else 1  # (a decode tier, or a prompt chunk)
                    if (context - n_tokens) / sequences >= DIRECT_RUN_BLOCKS * DEFAULT_BLOCK_SIZE:
                        # The copy engine reads the page-locked host cache in place, a copy a sequence's run of
                        # blocks (keys and values): the host issues them and scatters the new rows.
                        py += 2 * sequences * self.profile.fill_call_s() + self.profile.host_gather_s(new)
                    else:
                        if len(kv_in_read) >= KV_IN_BUFFERS:  # the gather's pinned buffer, read by an earlier copy
                            py = max(py, kv_in_read[-KV_IN_BUFFERS])
                        py += self.profile.host_gather_s(prefix + new)  # gather the prefix, scatter the new rows
                    ready = max(ready, written_back)  # the staging cache is free again
                    if prefix:
                        copy_start = max(copy_free, py)
                        copy_free = copy_start + self.profile.transfer_s(prefix, "h2d", cpu_work)
                        copy_busy += copy_free - copy_start
                        timeline.append((sublayer.name + " kv in", "copy", copy_start, copy_free))
                        kv_in_read.append(copy_free)
                        ready = max(ready, copy_free)
                start = max(gpu_free, ready, py)
                py += launch
                gpu_free = max(start + kernels, py)
                gpu_busy += kernels
                x_ready = gpu_free
                timeline.append((sublayer.name, "gpu", start, gpu_free))
                if w.stages_kv:
                    copy_start = max(copy_free, gpu_free)  # the copy stream waits for the attention
                    copy_free = written_back = copy_start + self.profile.transfer_s(new, "d2h", cpu_work)
                    copy_busy += copy_free - copy_start
                    timeline.append((sublayer.name + " kv out", "copy", copy_start, copy_free))
                if w.home == "stream" or w.coded:
                    slot_released[uses] = gpu_free
                    uses += 1
                    py += issue_fill(py)
            # Logits back to the host.
            if x_device == "cuda":
                py = max(py, x_ready) + self.crossing_s(logit_bytes, "d2h")
                x_device = "cpu"
            py = max(py, written_back)  # the step ends when every KV write-back has landed
            x_ready = py
        began, cpu0, gpu0, copy0 = last_start
        return StepEstimate(py - began, cpu_busy - cpu0, gpu_busy - gpu0, copy_busy - copy0, 0, timeline,
                            split_busy - split0)


def vram_decode_bps(profile: Profile) -> float:
    """Raw bytes a second the GPU decodes pinned coded weights at: as the profile measured it, else
    :data:`DECODE_SHARE` of its one-row read."""
    if profile.vram_decode_bps:
        return profile.vram_decode_bps
    seconds = profile.matmul_s(1, 4096, 14336, torch.bfloat16, "cuda")
    return DECODE_SHARE * 4096 * 14336 * 2 / seconds


def uniform_hit_rate(model: Model, cache_slots: int, cached_layers: int | None = None) -> float:
    """Expert-cache hit rate under uniform routing: the fraction of the cached layers' experts
    that fit in the cache (random routers route almost uniformly; real ones are skewed, so
    this is a floor — a measured rate is better)."""
    moe = [s for s in model if isinstance(s, MoEFFN)]
    if not moe or cache_slots <= 0:
        return 0.0
    layers = len(moe) if cached_layers is None else max(cached_layers, 1)
    return min(1.0, cache_slots / (layers * moe[0].num_experts))


def _expert_on_cpu_s(moe: MoEFFN, profile: Profile) -> float:
    """One expert at one token on the CPU while PCIe streams: its share of a token's top-k in the
    compiled pass, or (where that does not run) its two matmuls and the dispatch of its few operations."""
    passed = host_pass_s(profile, moe, 1, contended=True)
    if passed is not None:  # the compiled pass: a token's top-k experts, per expert
        return passed / moe.top_k
    dtype = moe.weights[0].dtype
    return (profile.matmul_s(1, moe.hidden, 2 * moe.intermediate, dtype, "cpu", contended=True)
            + profile.matmul_s(1, moe.intermediate, moe.hidden, dtype, "cpu", contended=True)
            + 6 * profile.dispatch_s("cpu"))


def expert_cpu_share(model: Model, profile: Profile) -> float:
    """Share of a decode step's expert-cache misses best computed on the CPU from host memory
    (the executor's ``expert_cpu_share``), the others being copied to VRAM meanwhile: both sides
    finish together when ``c * t_cpu = (m - c) * t_pcie``, i.e. ``c / m = t_pcie / (t_cpu + t_pcie)``,
    with t_cpu one expert at one token on the CPU and t_pcie the copy of one expert under CPU load."""
    moe = next(s for s in model if isinstance(s, MoEFFN))
    t_pcie = profile.transfer_s(moe.expert_bytes, "h2d", contended=True)
    return t_pcie / (_expert_on_cpu_s(moe, profile) + t_pcie)


def balanced_zero_copy_share(model: Model, profile: Profile) -> float:
    """Share of a decode step's host-memory experts best computed by the CPU while the GPU's
    zero-copy kernels read the others from pinned memory (the executor's ``zero_copy_cpu_share``):
    as :func:`expert_cpu_share`, with the kernels' read of one expert (the link at
    :func:`zero_copy_efficiency` of the copy engine's rate) in place of its copy."""
    moe = next(s for s in model if isinstance(s, MoEFFN))
    t_read = profile.transfer_s(moe.expert_bytes, "h2d", contended=True) / zero_copy_efficiency(profile)
    return t_read / (_expert_on_cpu_s(moe, profile) + t_read)
