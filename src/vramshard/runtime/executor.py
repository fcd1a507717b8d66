"""The executor: runs one forward step of a placement over the CPU and the GPU.

It alone owns the CUDA streams, events, VRAM slots and pinned buffers. One loop over
the sub-layers in model order: each computes where the placement says, activations
cross PCIe only where consecutive sub-layers change device, and streamed weights
arrive through a :class:`~vramshard.runtime.streaming.SlotRing` that the copy engine
fills ahead of the compute (with ``VRAMSHARD_WIRE_CODEC`` a bf16 model's fills cross coded: the
placements' streamed sub-layers are coded once, on the GPU, when their VRAM is laid out;
:mod:`~vramshard.runtime.wire_codec`).

MoE ``ffn[i]`` split at their experts (home ``experts``) keep norm and router in VRAM;
after the router ran, their experts run on the CPU (the routed hidden states cross to
the host and back) or come through the VRAM expert cache
(:mod:`~vramshard.runtime.expert_cache`), which copies only the routed experts it lacks
(:mod:`~vramshard.runtime.expert_split`).

Attention placed on the GPU with ``kv="host"`` keeps its KV cache in host memory: each step
stages that layer's KV through one small VRAM cache (:mod:`~vramshard.runtime.kv_staging`),
so prompt tiers can compute attention on the GPU while decode tiers compute it on the CPU,
and the KV cache never moves between tiers.

A dense FFN split between the CPU and the GPU (``Where.cpu_pieces``) streams only its GPU
part (its last pieces) through the ring; the step queues that part on the compute stream,
computes the first pieces on the CPU meanwhile (the copy engine already filling the next
streamed item), and adds the two where the FFN's input lives: the normalized activation
crosses to the other device once and its contribution comes back once
(:mod:`~vramshard.runtime.ffn_split`).
"""

from __future__ import annotations

import gc
import logging
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

import torch

from ..env import switch
from ..errors import BudgetError, InvalidInputError
from ..layers import cpu_gemv, cpu_linear, cpu_swiglu, host_experts
from ..layers.mlp import DenseFFN
from ..layers.embedding import Embedding
from ..layers.moe import DictExperts, MoEFFN, StackedExperts
from ..layers.step import Step
from ..models.base import Model
from ..plan.memory import ALLOCATOR_SLACK, VramNeed, kv_positions, tiered_vram_need
from ..plan.placement import Placement, TieredPlacement
from ..units import format_bytes
from .graphs import DecodeGraphs
from .expert_cache import CachedExperts, CacheStats, ExpertCache
from .expert_split import ExpertSplitSteps
from .host_allowance import available_host_bytes
from .host_weights import PackedWeights
from .kv_cache import KVCache
from .kv_staging import KVStaging
from . import run_ahead, team_tuner, vram_coded, wire_codec, zero_copy_experts
from .cpu_down import DownCopies
from .cpu_packed import PackedParts
from .dropped import DroppedBuffers
from .ffn_buffers import FFNBuffers
from .ffn_split import FFNSplitSteps
from .step_logits import StepLogits
from .streaming import SlotRing, StreamItem, item_bytes
from .streams import process_stream
from .timeline import Timeline

log = logging.getLogger(__name__)

# A re-plan whose placement keeps the same sub-layers resident, in the same order, keeps their VRAM buffer and the
# decode graphs captured over it (and their pool) instead of copying every resident weight in again and capturing
# anew: 25 of the 42 switches of the forty-third and forty-fourth GPU sessions pinned and unpinned nothing, and
# after some of them a new pool had no room for its first capture, so the plan's decode steps ran eagerly
# (docs/BENCHMARKS.md). Off (VRAMSHARD_KEEP_RESIDENT=off): every switch loads its resident weights afresh.
KEEP_RESIDENT = switch("VRAMSHARD_KEEP_RESIDENT", default=True)

_DEFAULT_THREADS: list[int] = []  # torch's CPU thread count before any executor changed it


def default_threads() -> int:
    """torch's CPU thread count before any executor changed it (the process's: its physical cores, or
    ``OMP_NUM_THREADS``)."""
    if not _DEFAULT_THREADS:
        _DEFAULT_THREADS.append(torch.get_num_threads())
    return _DEFAULT_THREADS[0]


def use_cpu_threads(threads: int | None) -> None:
    """Run CPU sub-layers on ``threads`` threads; None: the process default (all cores).

    The torch thread pool is process-wide, so an executor (or a tier) that asked for fewer
    threads must not leave them to the next one that asked for none.
    """
    wanted = threads or default_threads()
    if wanted != torch.get_num_threads():
        torch.set_num_threads(wanted)


@dataclass
class StepReport:
    """What the last step did: time, bytes streamed (expert-cache copies included), device
    crossings, and the expert cache's hits, misses and evictions in this step."""

    seconds: float = 0.0
    bytes_streamed: int = 0
    crossings: int = 0
    extra: dict = field(default_factory=dict)
    expert_hits: int = 0
    expert_misses: int = 0
    expert_evictions: int = 0
    host_compute_s: float = 0.0  # of ``seconds``, the host computing CPU sub-layers, split FFN CPU parts, CPU experts
    host_wait_s: float = 0.0  # of ``seconds``, the host blocked on GPU results it needs for that work
    host_split_s: float = 0.0  # of ``host_compute_s``, in split dense FFNs' CPU parts (on the host thread)

    @property
    def expert_hit_rate(self) -> float | None:
        """Routed experts found in the VRAM expert cache / routed experts asked for (None: none asked)."""
        asked = self.expert_hits + self.expert_misses
        return self.expert_hits / asked if asked else None


@dataclass(frozen=True)
class _Config:
    """What a tiered placement means for the executor, checked before any of it is applied."""

    plans: TieredPlacement
    budget: int | None
    kv_gpu: frozenset[int]  # attention layers whose KV cache lives in VRAM
    staged: bool  # some tier runs GPU attention over a host KV cache (a VRAM staging cache is needed)
    split: frozenset[str]  # MoE sub-layers some tier splits at their experts
    expert_cache_bytes: int
    need: VramNeed


@dataclass
class ReconfigureReport:
    """What :meth:`Executor.reconfigure` did and how long it took.

    release_s: from the call until the VRAM the new placement no longer needs was given back (KV
    moved out, old weights, slots and expert cache freed, the allocator's cache emptied);
    total_s: until the new placement was ready. ``reserved_*``: ``torch.cuda.memory_reserved``
    after the release and at the end (0 without a GPU).
    """

    release_s: float
    total_s: float
    kv_bytes_to_host: int
    kv_bytes_to_gpu: int
    reserved_after_release: int
    reserved_after: int
    need: VramNeed
    # Seconds of each part of the release: "wait" (the GPU finishing queued work), "kv" (KV caches
    # moved to host memory), "drop" (the placement's buffers and decode graphs dropped: back to
    # the caching allocator), "empty" (the allocator's cache emptied: back to the card), "collect"
    # (a garbage collection, only when a reference cycle still held old buffers).
    release_parts: dict = field(default_factory=dict)
    # Seconds of taking the new placement after the release: ``Executor._apply``'s host-side phases ("CPU parts",
    # the packed parts and down copies its CPU parts read; "CPU kernels", those compiled for it), then "VRAM" (its
    # resident weights copied in, the KV caches it wants moved there).
    apply_parts: dict = field(default_factory=dict)


class Executor(ExpertSplitSteps, FFNSplitSteps):
    """Runs ``model`` under ``placement``.

    host: the host copy of the weights, packed per sub-layer (:func:`pack_model`); pinned
    when the placement streams, so the copy engine reads it at full speed.
    budget: VRAM bytes the GPU side may use (None: no limit); checked before anything
    is allocated, with room for ``max_tokens`` new tokens per step and a KV cache of
    ``kv_slots`` sequences of ``max_context`` tokens.
    expert_cache: bytes of the VRAM expert cache when a placement caches experts (None: the
    tiered placement's ``expert_cache``, else room for 2 x top-k experts).
    simulate_gpu: plan, account and check VRAM as on the GPU, but compute every sub-layer on the
    CPU from host memory and allocate nothing on a GPU (tests and demonstrations of budgets and
    re-planning on a machine without one).
    decode_graphs: replay decode steps over runs of VRAM-resident sub-layers from CUDA graphs
    (:mod:`~vramshard.runtime.graphs`); decode_compile: a ``torch.compile`` backend (e.g.
    "inductor") for the fusable parts of those graphs (None: eager kernels).
    expert_cpu_share: of a decode-sized step's expert-cache misses, the share computed on the CPU
    from host memory while the others are copied in (None: all copied in; see ``_run_hybrid``).
    expert_prefetch: in decode-sized steps, guess the next cached MoE layer's experts from this
    layer's input and start copying the ones not cached (see ``_run_cached``).
    experts_zero_copy: in decode-sized steps, read experts in host memory by the GPU's kernels from
    pinned memory instead of computing them on the CPU (None: ``VRAMSHARD_EXPERTS_ZERO_COPY``; see
    :mod:`~vramshard.runtime.zero_copy_experts`). zero_copy_cpu_share: of the routed experts of
    such a step in host memory, the share the CPU computes meanwhile (see ``_run_zero_copy``; None:
    the placement's, per tier, :attr:`TieredPlacement.zero_copy_cpu_shares`, which the planner sets
    only with the run-ahead worker: on the H200 machine every share computed on the host thread made
    decode slower, while on the worker the balanced share of 0.556 decoded at 15.32 against 12.45
    tok/s for the kernels alone, twenty-third GPU session; in the twenty-fourth a share of 0.375
    decoded at 3.98 tok/s, likely on a one-thread kernel from the compile cache: docs/BENCHMARKS.md).
    wire_codec_on: whether stream fills of bf16 weights cross the link coded (None: ``VRAMSHARD_WIRE_CODEC``).

    :meth:`reconfigure` switches to another placement while running (a VRAM budget that changed),
    rebuilding only the VRAM side: the host weights stay, KV caches move where the new placement
    wants them. ``oom_handler``: called when a step runs out of VRAM, to make the executor smaller
    (normally through :meth:`reconfigure`) before the step is retried.
    """

    def __init__(self, model: Model, host: dict[str, PackedWeights], placement: Placement | TieredPlacement,
                 budget: int | None = None, max_tokens: int = 2048, max_context: int = 4096, kv_slots: int = 1,
                 num_slots: int = 2, threads: int | None = None, device: str | torch.device = "cuda",
                 expert_cache: int | None = None, simulate_gpu: bool = False, decode_graphs: bool = False,
                 expert_cpu_share: float | None = None, decode_compile: str | None = None,
                 expert_prefetch: bool = False, experts_zero_copy: bool | None = None,
                 zero_copy_cpu_share: float | None = None, wire_codec_on: bool | None = None):
        self.model = model
        if zero_copy_cpu_share is not None and not 0.0 <= zero_copy_cpu_share <= 1.0:
            raise ValueError(f"zero_copy_cpu_share must be a share between 0 and 1, got {zero_copy_cpu_share}")
        # Of host experts at decode, the share the CPU computes beside the kernels (None: the plan's).
        self.zero_copy_cpu_share = zero_copy_cpu_share
        self.expert_prefetch = expert_prefetch
        # Host-memory experts read by the GPU's kernels at decode sizes (None: VRAMSHARD_EXPERTS_ZERO_COPY).
        self.experts_zero_copy = zero_copy_experts.ENABLED if experts_zero_copy is None else experts_zero_copy
        self.decode_compile = decode_compile  # torch.compile backend for the graphs' fusable parts (None: eager)
        # Of a decode-sized step's expert-cache misses, this share is computed on the CPU from host
        # memory while the rest are copied in (None: all copied in). See _run_hybrid.
        self.expert_cpu_share = expert_cpu_share
        self.decode_graphs = decode_graphs  # replay decode steps over resident runs from CUDA graphs
        # Stream fills cross the link coded (VRAMSHARD_WIRE_CODEC, or ``wire_codec_on``; bf16 models): see
        # runtime/wire_codec.
        self.wire_codec = wire_codec.wire_ratio(model.dtype, wire_codec_on) < 1
        self._lock = threading.RLock()
        self.threads = threads
        self.sparing_core = False  # a core left to the planning process while it plans (spare_a_core)
        self.step_threads: int | None = None  # the CPU threads the last step computed on
        use_cpu_threads(threads)
        self.kv_plan = (kv_slots, max_context)
        self.max_tokens = max_tokens
        self.num_slots = num_slots
        self.simulated = simulate_gpu
        self.report = StepReport()
        self._host_compute_s = self._host_wait_s = self._host_split_s = 0.0  # of the step running (StepReport)
        self._worker_parts: dict[str, float] = {}  # the run-ahead worker's parts of the step running (RunAhead.last_parts)
        self.oom_handler: Callable[[str], None] | None = None
        self.oom_retries = 3  # steps retried after the handler made room, before giving up
        self._kv_caches: weakref.WeakSet[KVCache] = weakref.WeakSet()  # live caches, moved on reconfigure
        self._queues: dict = {}  # placement -> queues_without_waiting

        self.host = host
        # Views of split FFNs' CPU parts in the host weights, by (sub-layer, CPU pieces): made once.
        self._cpu_parts: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
        self.gpu: torch.device | None = None
        self._device = torch.device("cpu") if simulate_gpu else torch.device(device)
        # Dense FFNs on the CPU at many rows; results pinned where they may be copied to a GPU.
        self._ffn_buffers = FFNBuffers(pinned=self._device.type == "cuda" and torch.cuda.is_available())
        # CPU FFN parts prepacked for oneDNN (VRAMSHARD_CPU_PACKED; auto: beside a real GPU).
        self._packed = PackedParts(gpu=False if simulate_gpu else None)
        # row-major copies of CPU parts' down projections, one per FFN (its widest CPU part)
        self._down_copies = DownCopies(views_of=lambda name, pieces: self._cpu_part(self.model[name], pieces))
        self._host_moe: dict[str, DictExperts] = {}  # MoE sub-layer -> its host buffer's experts, stacked
        self._run_ahead: run_ahead.RunAhead | None = None  # split FFNs' CPU parts on a worker (opt-in)
        self._run_ahead_tried = False
        self._worker_team: int | None = None  # the run-ahead worker's team in the step running
        self._team_tuner: team_tuner.TeamTuner | None = None  # that team by the worker's times (made with the worker)
        self._tuned_tokens: int | None = None  # tokens of the step running, where the tuner gave its team
        self.team_trial_steps = 0  # steps run so far with a team on trial (the engine does not fit them)
        self.compute_stream = self.copy_stream = self.decode_stream = None
        self._vram_before = 0
        self._reserved_after_step = 0  # VRAM reserved after the last step, less _vram_before
        self._clear_vram()
        # Wall seconds of this executor's setup by phase (Engine.load_seconds reports them).
        self.setup = Timeline()
        self._apply(self._configure(placement, budget, expert_cache), self.setup)
        if self.uses_gpu:
            with self.setup.phase("VRAM"):
                self._start_gpu()
                self._load_vram()

    # ------------------------------------------------------------------ setup
    def _configure(self, placement: Placement | TieredPlacement, budget: int | None,
                   expert_cache: int | None) -> _Config:
        """Check ``placement`` under ``budget`` without changing anything."""
        plans = placement if isinstance(placement, TieredPlacement) else TieredPlacement.single(placement)
        for p in plans.placements:
            missing = [s.name for s in self.model if s.name not in p.as_dict()]
            if missing:
                raise ValueError(f"placement {p.name} does not place {', '.join(missing[:3])}")
        kv_gpu = self._kv_layers_on_gpu(plans)
        self._check_ffn_splits(plans)
        self._check_coded(plans)
        split = self._expert_split(plans)
        cache_bytes = self._expert_cache_bytes(plans, split, expert_cache)
        kv_slots, max_context = self.kv_plan
        need = tiered_vram_need(self.model, plans, kv_slots, max_context, self.max_tokens, self.num_slots,
                                cache_bytes, wire_coded=self.wire_codec)
        need.check(budget, f"placement {plans.name}")
        if plans.uses_gpu and not self.simulated and not torch.cuda.is_available():
            raise InvalidInputError(f"placement {plans.name} computes on the GPU, but no CUDA GPU is available")
        staged = any(p.staged_kv_names() for p in plans.placements)
        return _Config(plans, budget, frozenset(kv_gpu), staged, frozenset(split), cache_bytes, need)

    def _check_coded(self, plans: TieredPlacement) -> None:
        """Sub-layers pinned coded are bf16 attention or dense FFNs (what a stream slot holds and the code fits)."""
        coded = sorted({n for p in plans.placements for n in p.coded_names()})
        if coded and self.model.dtype != torch.bfloat16:
            raise InvalidInputError(f"placement {plans.name} keeps {', '.join(coded[:3])} coded in VRAM, but the "
                                    f"model's weights are {self.model.dtype} (the code is for bf16 weights)")
        wrong = [n for n in coded if self.model[n].kind not in ("attn", "ffn") or isinstance(self.model[n], MoEFFN)]
        if wrong:
            raise InvalidInputError(f"placement {plans.name} keeps {', '.join(wrong[:3])} coded in VRAM: only "
                                    "attention and dense FFN sub-layers are kept coded (decoded into a stream slot)")

    def _apply(self, config: _Config, timeline: Timeline | None = None) -> None:
        """Make ``config`` current, with the host-side work it needs (``timeline``: where that work's
        seconds go)."""
        timeline = timeline or Timeline()
        self.plans = config.plans
        self.placement = config.plans.placements[0]
        if self._team_tuner is not None:
            self._team_tuner.reset()  # (other work in each step)
        self.budget = config.budget
        self._kv_gpu = set(config.kv_gpu)
        self._staged = config.staged
        self.split = set(config.split)
        self.expert_cache_bytes = config.expert_cache_bytes
        self.uses_gpu = config.plans.uses_gpu
        self.need: VramNeed = config.need
        with timeline.phase("CPU parts"):  # prepacked parts and down copies the CPU reads
            self._packed.packs_rows = config.plans.packs  # (the tiers the plan packs)
            cpu_parts = self._cpu_ffn_parts(config.plans)
            self._packed.keep(cpu_parts)
            self._down_copies.keep(cpu_parts)
            self._prepare_cpu_parts(config.plans)
        with timeline.phase("CPU kernels"):
            self._warm_cpu_kernels(config.plans)

    def limit_threads(self, threads: int | None) -> None:
        """Compute on at most ``threads`` CPU threads from the next step on (None: as each tier's plan
        says): the engine's ``--threads``, or the cores other work leaves it (:mod:`~vramshard.budget_follower`).
        The run-ahead worker's team tuning starts again (its teams lie below the step's threads)."""
        with self._lock:
            self.threads = threads  # (each step sets the thread pool from it)
            if self._team_tuner is not None:
                self._team_tuner.reset()

    def spare_a_core(self, spare: bool) -> None:
        """From the next step on, compute on one thread fewer than the tier asks (never fewer than one),
        or as asked again: while the planning process makes a plan (:mod:`~vramshard.runtime.plan_process`,
        at the idle scheduling class), it gets a core only where none of the steps' threads wants one, and
        beside a team on every core it got none: on the development machine a plan of 1.65 s alone did not
        come back in 28.5 s of decode steps on both cores (``benchmarks.plan_beside_steps``, docs/BENCHMARKS.md,
        "Changed in session 43")."""
        self.sparing_core = spare

    def _tier_threads(self, planned: int | None) -> int | None:
        """A tier's CPU threads: the plan's (None: this executor's ``threads``), never more than
        ``threads`` where that is set (the engine's ``--threads``, or the cores the load beside it leaves:
        :meth:`limit_threads`), one fewer while a core is spared (:meth:`spare_a_core`)."""
        if planned is None or self.threads is None:
            threads = planned or self.threads
        else:
            threads = min(planned, self.threads)
        if self.sparing_core:
            threads = max(1, (threads or default_threads()) - 1)
        return threads

    def _warm_cpu_kernels(self, plans: TieredPlacement) -> None:
        """Compile the CPU's decode-sized kernels (one-token projections, :mod:`~vramshard.layers.cpu_linear`;
        a few tokens' routed experts, :mod:`~vramshard.layers.host_experts`; dense FFNs of a few rows
        in one call, :mod:`~vramshard.layers.cpu_swiglu`, where parts are not prepacked) before the first
        step that needs them, where a decode-sized tier computes on the CPU, at that tier's thread
        count, and at the run-ahead worker's where it will compute split parts or experts."""
        smallest = (1,) + tuple(t + 1 for t in plans.tiers[:-1])  # the fewest tokens of each tier's steps
        ahead = run_ahead.available() and not self.simulated  # (host experts; split parts: run_ahead.takes_dense)
        for tier, fewest, placement, threads, team in zip(plans.tiers, smallest, plans.placements, plans.threads,
                                                          plans.worker_threads or (None,) * len(plans.tiers)):
            if fewest > max(cpu_linear.MAX_TOKENS, cpu_swiglu.MAX_ROWS):
                continue
            where = placement.as_dict()
            on_cpu = [s for s in self.model if s.name in where and (where[s.name].compute == "cpu"
                      or where[s.name].cpu_pieces or where[s.name].experts == "host")]
            if not on_cpu:
                continue
            use_cpu_threads(self._tier_threads(threads))
            counts = [torch.get_num_threads()]
            if ahead and any(where[s.name].cpu_pieces and run_ahead.BOUND or where[s.name].experts == "host"
                             for s in on_cpu):
                counts.append(run_ahead.worker_threads(counts[0], team))  # (as submit gives the worker)
            packed = self._packed.enabled and plans.packs(tier)
            for count in dict.fromkeys(counts):  # (in order, once each)
                use_cpu_threads(count)
                began = time.perf_counter()
                # (prepacked parts do not use these kernels: a part past the packing allowance compiles
                # them on first use)
                if (any(isinstance(s, DenseFFN) for s in on_cpu) and fewest <= cpu_swiglu.MAX_ROWS
                        and not packed and not cpu_gemv.computes(tier)):
                    cpu_swiglu.warm_up(self.model.dtype)
                if fewest <= cpu_linear.MAX_TOKENS:
                    self._warm_projections_and_experts(on_cpu, packed)
                took = time.perf_counter() - began
                if took > 0.5:  # (compiled now, not found compiled)
                    log.info("CPU kernels for %d thread(s) (tier %d): %.1f s", count, fewest, took)

    def _warm_projections_and_experts(self, on_cpu: list, packed: bool) -> None:
        # Not for sub-layers that project nothing through cpu_linear on the CPU: the embedding (a
        # lookup), and dense FFNs whose parts are prepacked (``packed``: oneDNN's products). On the H100
        # machine this compile took 43 s of nemo-8b's 66 s load at 8 GiB, where the CPU computed only those.
        if any(not isinstance(s, Embedding) and not (isinstance(s, DenseFFN) and packed) for s in on_cpu):
            cpu_linear.warm_up(self.model.dtype)
        moe = next((s for s in on_cpu if isinstance(s, MoEFFN)), None)
        stacked = self._host_experts_of(moe).stacked() if moe is not None else None
        if stacked is not None and host_experts.eligible(torch.zeros(1, moe.hidden, dtype=stacked.gate_up.dtype),
                                                         stacked.gate_up):
            host_experts.warm_up(*stacked)


    def _start_gpu(self) -> None:
        """Once, when the GPU is first used: streams, peak statistics (a simulated GPU is the CPU)."""
        if self.gpu is not None:
            return
        self.gpu = self._device
        if self.simulated:
            return
        gc.collect()  # engines dropped earlier in this process give their VRAM back first
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.gpu)
        self._vram_before = torch.cuda.memory_reserved(self.gpu)
        # cuDNN attention rebuilds its plan for every new KV length (milliseconds of CPU per
        # decode step); the flash and memory-efficient kernels have no such cost.
        torch.backends.cuda.enable_cudnn_sdp(False)
        self.compute_stream = process_stream(self.gpu, "compute")  # (one per process: see streams.py)
        self.copy_stream = process_stream(self.gpu, "copy")
        self.decode_stream = process_stream(self.gpu, "decode")  # pinned coded weights into their slots

    def _load_vram(self, keep_resident: bool = False) -> None:
        """Resident weights, split routers, the expert cache, the stream ring and the KV staging
        cache of the placement (a simulated GPU stages KV through a CPU cache). ``keep_resident``: the
        resident weights (and the decode graphs over them, if kept) are in VRAM already."""
        if self._staged and self.uses_gpu:
            a = self.model.args
            self.staging = KVStaging(kv_positions(*self.kv_plan), a.num_key_value_heads, a.head_dim, self.model.dtype,
                                     self.gpu, self.copy_stream)
        if self.simulated or not self.uses_gpu:
            return
        streamed = {item for p in self.plans.placements for item in _streamed(p, list(self.model))}
        coded = set(self.placement.coded_names())
        if self.wire_codec:
            self._code({item[0] if isinstance(item, tuple) else item for item in streamed} - coded)
        if self.wire_codec and coded:  # the coded pins' too, where the host has room: a switch then copies them in
            self._code(coded, pins=True)
        if not keep_resident:
            self._load_resident()
        self._load_split()
        if self.decode_graphs and self.resident:
            room = None if self.budget is None else max(0, self.budget - self.need.total)
            if self.graphs is not None and self.graphs.key_buckets[-1] == self.kv_plan[1]:
                self.graphs.pool_limit = room  # (kept over the kept weights: see _keeps_graphs)
            else:
                self.graphs = DecodeGraphs(self.resident, self.gpu, self.kv_plan[1], pool_limit=room,
                                           compile_backend=self.decode_compile)
        if streamed:
            slot_bytes = max(item_bytes(self.host, item) for item in streamed)
            self.ring = SlotRing(slot_bytes, self.host, self.num_slots, self.gpu, self.copy_stream, self.wire_codec,
                                 self._vram_coded, self.decode_stream)
        torch.cuda.synchronize(self.gpu)

    def _code(self, names, pins: bool = False) -> None:
        """Give the host weights of the sub-layers ``names`` their coded blocks where they have none,
        coded on the GPU (before this placement's VRAM is taken: the coder's temporaries are freed).
        Where the host lacks the room the link's fills stay raw; ``pins`` (sub-layers pinned coded in VRAM,
        whose coded host copies only spare a switch their coding): then those alone go without."""
        todo = [name for name in names if self.host[name].coded is None]
        if not todo:
            return
        raw = sum(self.host[n].buffer.numel() for n in todo)
        available = available_host_bytes()
        if wire_codec.host_room(raw, available) is None:
            if pins:
                log.info("the pins kept coded in VRAM have no coded host copies (%s would pass %d%% of the %s "
                         "available): a switch codes them again", format_bytes(wire_codec.coded_bytes(raw)),
                         round(100 * wire_codec.HOST_SHARE), format_bytes(available))
                return
            log.warning("not coding the streamed weights for the link: their coded copies would take %s of host "
                        "memory, over %d%% of the %s available; their fills stay raw (VRAMSHARD_WIRE_CODEC)",
                        format_bytes(wire_codec.coded_bytes(raw)),
                        round(100 * wire_codec.HOST_SHARE), format_bytes(available))
            self.wire_codec = False
            return
        began = time.perf_counter()
        for name in todo:
            self.host[name].coded = wire_codec.CodedBuffer(self.host[name].buffer, self.gpu)
        torch.cuda.empty_cache()
        wire = sum(self.host[n].coded.wire_bytes() for n in todo)
        log.info("coded %d %s sub-layers' host weights for the link in %.2f s: %s over it for %s raw (x%.3f)",
                 len(todo), "pinned" if pins else "streamed", time.perf_counter() - began, format_bytes(wire),
                 format_bytes(raw), wire / max(raw, 1))

    def _clear_vram(self, keep_resident: bool = False) -> None:
        """Forget every VRAM buffer of the placement (KV caches are not the executor's to drop);
        ``keep_resident``: but the resident weights and the decode graphs over them (:meth:`_keeps_resident`)."""
        if not keep_resident:
            self.resident: dict[str, dict[str, torch.Tensor]] = {}
            self._resident_buffer: torch.Tensor | None = None
            self._vram_coded: dict[str, vram_coded.VramCoded] = {}  # pinned coded sub-layers (Where.coded)
            self.graphs: DecodeGraphs | None = None  # captured over the resident weights: dropped with them
        self._router_buffer: torch.Tensor | None = None  # routers of split MoE sub-layers, back to back
        self.ring: SlotRing | None = None
        self.expert_cache: ExpertCache | None = None
        self.split_weights: dict[str, CachedExperts | dict] = {}  # split sub-layer -> router (+ cached experts)
        self._next_cached: dict[str, str] = {}  # MoE sub-layer with cached experts -> the next one
        self.host_experts: dict[str, DictExperts] = {}  # split sub-layer -> its experts in host memory
        self._host_stacked: dict[str, StackedExperts] = {}  # the same, pinned and stacked: read by GPU kernels
        self._slot_tables: dict[str, tuple[int, torch.Tensor]] = {}  # cached layer -> (cache version, slot table)
        self._gpu_steps = 0  # steps run on the GPU since then (every REFRESH_STEPS-th lets the cache admit)
        self.staging: KVStaging | None = None  # GPU attention over host KV caches: one layer's KV in VRAM
        self._sim_slot: torch.Tensor | None = None  # a simulated GPU's slot for split FFNs' GPU parts

    @property
    def resident_weight_bytes(self) -> int:
        """Packed bytes of the weights the placement pins in VRAM (raw or coded: those no step moves)."""
        return sum(self.host[name].layout.nbytes for name in self.placement.names(home="vram"))

    def reserved_bytes(self) -> int:
        """``torch.cuda.memory_reserved`` of the engine's GPU now (0 without a real GPU)."""
        if self.gpu is None or self.simulated:
            return 0
        return torch.cuda.memory_reserved(self.gpu)

    # ------------------------------------------------------------------ changing the placement
    def reconfigure(self, placement: Placement | TieredPlacement, budget: int | None,
                    expert_cache: int | None = None) -> ReconfigureReport:
        """Switch to ``placement`` under ``budget`` between two steps, keeping the host weights.

        VRAM the new placement does not need is given back first (KV caches of layers whose
        attention now runs on the CPU move to host memory, old resident weights, slots and the
        expert cache are freed, the allocator's cache is emptied), then the new placement's
        weights are copied in and KV caches it wants in VRAM move there. Block tables and cache
        content are untouched, so running sequences go on. Raises BudgetError (changing nothing)
        when the placement does not fit the budget or the live KV caches do not fit its KV reservation.
        """
        with self._lock:
            start = time.perf_counter()
            config = self._configure(placement, budget, expert_cache)
            self._check_kv_fits(config)
            real_gpu = self.gpu is not None and not self.simulated
            parts = {}
            mark = time.perf_counter()
            if real_gpu:
                torch.cuda.synchronize(self.gpu)
            parts["wait"], mark = time.perf_counter() - mark, time.perf_counter()
            dropped = DroppedBuffers()  # (what the switch drops from VRAM, to ask whether it went)
            moving_out = self._kv_gpu - config.kv_gpu
            dropped.watch(*(t for cache in list(self._kv_caches) for t in cache.tensors(moving_out)))
            to_host = self._move_kv(moving_out, torch.device("cpu"))
            kept = sum(cache.bytes_on("cuda") for cache in list(self._kv_caches))  # (and below: what stays)
            parts["kv"], mark = time.perf_counter() - mark, time.perf_counter()
            keep = self._keeps_resident(config)
            kept += self._watch_dropped(config, keep, dropped)
            self._clear_vram(keep_resident=keep)
            self.report = StepReport()
            parts["drop"], mark = time.perf_counter() - mark, time.perf_counter()
            if real_gpu:
                torch.cuda.empty_cache()
            parts["empty"], mark = time.perf_counter() - mark, time.perf_counter()
            # A reference cycle still holds old buffers: collect (slow: only when needed). The process's VRAM
            # counts other engines' too (two in benchmarks/paired_decode.py), hence the buffers asked first.
            if real_gpu and dropped.held() and \
                    torch.cuda.memory_reserved(self.gpu) - self._vram_before > kept + ALLOCATOR_SLACK:
                gc.collect()
                torch.cuda.empty_cache()
                parts["collect"] = time.perf_counter() - mark
            released = time.perf_counter() - start
            reserved_after_release = self.reserved_bytes()
            moving_in = config.kv_gpu - self._kv_gpu
            applying = Timeline()
            self._apply(config, applying)
            with applying.phase("VRAM"):  # the new resident weights copied in, the KV caches it wants moved there
                if self.uses_gpu:
                    self._start_gpu()
                    self._load_vram(keep_resident=keep)
                to_gpu = self._move_kv(moving_in, self.gpu) if moving_in else 0
                if self.gpu is not None and not self.simulated:
                    torch.cuda.synchronize(self.gpu)
            report = ReconfigureReport(released, time.perf_counter() - start, to_host, to_gpu,
                                       reserved_after_release, self.reserved_bytes(), self.need, parts,
                                       dict(applying.seconds))
            log.info("reconfigured to %s in %.1f ms (VRAM released after %.1f ms; %s; KV moved: %s to host, %s to "
                     "GPU)", self.describe(), report.total_s * 1e3, released * 1e3,
                     ", ".join(f"{name} {seconds * 1e3:.1f} ms" for name, seconds in applying.seconds.items()),
                     format_bytes(to_host), format_bytes(to_gpu))
            return report

    def _keeps_resident(self, config: _Config) -> bool:
        """Whether a switch to ``config`` keeps the resident weights as they lie in VRAM (KEEP_RESIDENT): on a
        real GPU, the same sub-layers resident, in the same order (so in the same places of the buffer)."""
        if not KEEP_RESIDENT or self.gpu is None or self.simulated or self._resident_buffer is None \
                or not config.plans.uses_gpu:
            return False
        new = config.plans.placements[0]
        return new.names(home="vram") == self.placement.names(home="vram") \
            and new.coded_names() == self.placement.coded_names()

    def _watch_dropped(self, config: _Config, keep_resident: bool, dropped: DroppedBuffers) -> int:
        """Before a switch to ``config`` clears the placement's VRAM buffers: watch in ``dropped`` those it
        drops, and drop the decode graphs where a switch keeping the resident weights cannot keep them
        (:meth:`_keeps_graphs`); the bytes it keeps in VRAM (the resident buffer and the graphs' pool)."""
        dropped.watch(self.ring, self.expert_cache, self.staging, self._router_buffer)
        if not keep_resident:
            dropped.watch(self._resident_buffer, self.graphs, *(c.buffer for c in self._vram_coded.values()))
            return 0
        kept = self._resident_buffer.numel() + sum(c.vram_bytes for c in self._vram_coded.values())
        if self.graphs is not None and self._keeps_graphs(config):
            kept += self.graphs.pool_bytes
        elif self.graphs is not None:
            dropped.watch(self.graphs)
            self.graphs = None  # (a new pool after the switch, as after any other)
        return kept

    def _keeps_graphs(self, config: _Config) -> bool:
        """Whether a switch to ``config`` that keeps the resident weights keeps the decode graphs over them
        too: not where their pool passes the room ``config`` leaves."""
        room = None if config.budget is None else max(0, config.budget - config.need.total)
        return room is None or self.graphs.pool_bytes <= room

    def _check_kv_fits(self, config: _Config) -> None:
        """The live KV caches fit what ``config`` reserves for the layers it keeps in VRAM."""
        if not config.kv_gpu:
            return
        live = self.live_kv_positions()
        slots, ctx = self.kv_plan
        if live > slots * ctx:
            raise BudgetError(f"the live KV caches hold {live} positions, more than the {slots * ctx} reserved "
                              f"in VRAM by placement {config.plans.name}; keep the KV cache in host memory")

    def _move_kv(self, layers: set[int] | frozenset[int], device: torch.device) -> int:
        if not layers:
            return 0
        moved = 0
        for cache in list(self._kv_caches):
            moved += cache.move_layers(sorted(layer for layer in layers if layer in cache.layers), device)
        return moved

    @property
    def lock(self) -> threading.RLock:
        """Held during every step and every reconfigure: hold it to change anything between steps."""
        return self._lock

    def live_kv_positions(self) -> int:
        """Positions of the KV caches made by :meth:`new_kv_cache` that are still in use."""
        return sum(cache.slots * cache.max_ctx for cache in list(self._kv_caches))

    @property
    def kv_layers_on_gpu(self) -> set[int]:
        """Attention layers whose KV cache the placement keeps in VRAM (and computes there)."""
        return set(self._kv_gpu)

    def _load_resident(self) -> None:
        """Copy each VRAM-resident sub-layer's packed buffer into VRAM: one transfer per sub-layer,
        the same layout as on the host, so fused views come for free here too. Those pinned coded
        (``Where.coded``) are coded on the GPU and kept so (:mod:`~vramshard.runtime.vram_coded`)."""
        coded = set(self.placement.coded_names())
        names = [name for name in self.placement.names(home="vram") if name not in coded]
        if coded:
            self._load_coded(sorted(coded, key=[s.name for s in self.model].index))
        if not names:
            return
        total = sum(self.host[name].layout.nbytes for name in names)
        self._resident_buffer = torch.empty(total, dtype=torch.uint8, device=self.gpu)
        cursor = 0
        for name in names:
            packed = self.host[name]
            block = self._resident_buffer[cursor : cursor + packed.layout.nbytes]
            block.copy_(packed.buffer, non_blocking=True)
            views = packed.layout.views(block)
            sublayer = self.model[name]
            # Resident experts lie at one stride: a few-token step gathers them without a host sync.
            self.resident[name] = DictExperts(views, sublayer.num_experts, stack=True) \
                if isinstance(sublayer, MoEFFN) else views
            cursor += packed.layout.nbytes

    def _load_coded(self, names: list[str]) -> None:
        """Code the sub-layers ``names`` on the GPU and keep them coded in VRAM (their coder's temporaries
        freed before the rest of the placement's VRAM is taken)."""
        began = time.perf_counter()
        for name in names:
            try:  # (from the link codec's coded host copy where there is one)
                self._vram_coded[name] = vram_coded.VramCoded(self.host[name].buffer, self.gpu, self.host[name].coded)
            except vram_coded.CodingError as exc:
                raise InvalidInputError(f"placement {self.placement.name} keeps {name} coded in VRAM, but {exc}; "
                                        "plan without VRAMSHARD_VRAM_CODEC") from None
        torch.cuda.empty_cache()
        raw = sum(c.nbytes for c in self._vram_coded.values())
        held = sum(c.vram_bytes for c in self._vram_coded.values())
        copied = sum(c.copied for c in self._vram_coded.values())
        log.info("kept %d pinned sub-layers coded in VRAM (%d copied from coded host copies; in %.2f s): %s for %s raw "
                 "(x%.3f)", len(names), copied, time.perf_counter() - began, format_bytes(held), format_bytes(raw),
                 held / max(raw, 1))


    def _kv_layers_on_gpu(self, plans: TieredPlacement) -> set[int]:
        """Attention layers whose KV cache lives in VRAM: those computed on the GPU beside it.

        KV caches stay put across tiers, so a layer's KV home must be the same in every tier;
        where its attention computes may differ when the KV cache is in host memory (CPU
        attention in one tier, GPU attention over the host KV cache, ``kv="host"``, in another).
        """
        attention = {s.name for s in self.model.attention_layers}
        for p in plans.placements:
            wrong = [n for n in p.staged_kv_names() if n not in attention]
            if wrong:
                raise InvalidInputError(f"placement {p.name} gives {', '.join(wrong[:3])} a host KV cache (kv@host), "
                                        "but only attention sub-layers have a KV cache")
        on_gpu = set()
        for s in self.model.attention_layers:
            homes = {p[s.name].kv_in_vram for p in plans.placements}
            if len(homes) != 1:
                raise InvalidInputError(
                    f"placement {plans.name} keeps the KV cache of {s.name} in VRAM in some tiers and in host memory "
                    "in others, but KV caches do not move between tiers; where its attention runs on the GPU with "
                    "the KV cache in host memory, place it with kv='host' (kv@host)")
            if homes == {True}:
                on_gpu.add(s.layer)
        return on_gpu

    def kv_device(self, layer: int) -> torch.device:
        return self.gpu if layer in self._kv_gpu and self.gpu is not None else torch.device("cpu")

    def new_kv_cache(self, slots: int, max_ctx: int) -> KVCache:
        """A KV cache for ``slots`` sequences of ``max_ctx`` tokens, each layer beside its attention."""
        planned_slots, planned_ctx = self.kv_plan
        if self.uses_gpu and slots * max_ctx > planned_slots * planned_ctx:
            needed = tiered_vram_need(self.model, self.plans, slots, max_ctx, 1).kv
            raise BudgetError(
                f"a KV cache for {slots} sequence(s) of {max_ctx} tokens needs {format_bytes(needed)} of VRAM, "
                f"more than the {format_bytes(self.need.kv)} reserved when the model was loaded "
                f"({planned_slots} x {planned_ctx} tokens); load with a larger max_context"
            )
        a = self.model.args
        layers = [s.layer for s in self.model.attention_layers]
        with self._lock:  # not while reconfigure moves the caches
            cache = KVCache(layers, slots, max_ctx, a.num_key_value_heads, a.head_dim, self.model.dtype,
                            self.kv_device, pin_host=self.staging is not None and self.staging.on_gpu)
            self._kv_caches.add(cache)
        return cache

    # ------------------------------------------------------------------ run
    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, step: Step) -> torch.Tensor:
        """token ids [T] → float32 logits [R, V] (R: the step's logit rows), on the CPU."""
        return self._run(self.token_sublayers, token_ids, step, step.num_tokens)

    def queues_without_waiting(self, tokens: int) -> bool:
        """Whether a step of ``tokens`` new tokens is only queued on the GPU, the host waiting for
        nothing until its logits are read: every sub-layer of the tier's placement computes on the
        GPU from VRAM or a stream slot, with no CPU part, split FFN, MoE routing (which reads the
        router's choice on the host) or staged KV cache. Only such a step is worth queueing before
        the step before it is read (see :mod:`~vramshard.runtime.scheduler`)."""
        if self.gpu is None or self.simulated or not self.uses_gpu:
            return False
        placement, _ = self.plans.for_tokens(tokens)
        key = ("queues", placement)
        known = self._queues.get(key)
        if known is None:
            where = placement.as_dict()
            known = self._queues[key] = all(
                where[s.name].compute == "gpu" and where[s.name].home in ("vram", "stream") and not where[s.name].split
                and not where[s.name].stages_kv and not isinstance(s, MoEFFN) for s in self.token_sublayers)
        return known

    @torch.inference_mode()
    def forward_logits(self, token_ids: torch.Tensor, step: Step) -> StepLogits:
        """:meth:`forward`, the logits left where the head computed them (on a GPU: queued on the
        compute stream, not waited for). ``token_ids`` may live on the GPU (a previous step's
        sampled tokens, :class:`~vramshard.runtime.step_logits.TokenIds`). Read the result before
        the next step (a decode graph's output buffer is reused)."""
        logits = self._run(self.token_sublayers, token_ids, step, step.num_tokens, to_host=False)
        on_gpu = logits.device.type == "cuda" and not self.simulated
        return StepLogits(logits, self.compute_stream if on_gpu else None)

    @cached_property
    def token_sublayers(self) -> list:
        """The sub-layers a token step runs: all but a vision encoder's (run apart, by :meth:`run_sublayers`)."""
        return [s for s in self.model if s.kind != "vision"]

    @torch.inference_mode()
    def run_sublayers(self, names: list[str], x: torch.Tensor, step, tokens: int | None = None) -> torch.Tensor:
        """Run only the sub-layers ``names`` (model order) on ``x``; the result comes back on the CPU.

        For phases that are not token steps, e.g. the vision encoder (``step`` is then its
        ``VisionStep``). The placement is the one for ``tokens`` (default: rows of ``x``).
        """
        wanted = set(names)
        return self._run([s for s in self.model if s.name in wanted], x, step, tokens or x.shape[0])

    def _run(self, sublayers: list, x: torch.Tensor, step, tokens: int, to_host: bool = True) -> torch.Tensor:
        """The one loop: each sub-layer where the tier's placement says; activations cross
        PCIe only where consecutive sub-layers change device. One run at a time: the streams,
        slot ring and expert cache are shared by every thread that uses this executor.
        ``to_host``: bring the output to the CPU (else it stays where the last sub-layer ran)."""
        with self._lock:
            for attempt in range(self.oom_retries + 1):
                try:
                    out = self._run_locked(sublayers, x, step, tokens, to_host)
                    self._trim_allocator_cache()
                    return out
                except torch.cuda.OutOfMemoryError as exc:
                    failure = str(exc).splitlines()[0] if str(exc) else "out of memory"
                # Outside the except clause: the traceback's frames (holding the failed step's
                # tensors) are gone, so their VRAM can be given back.
                self._after_oom(failure, attempt)
            raise AssertionError("unreachable")

    def _trim_allocator_cache(self) -> None:
        """Give the allocator's cached free blocks back to the card after a step when what this
        process reserves grows past the plan, or grew and leaves less room under the budget than
        a step's planned workspace.

        Prompt chunks over a growing context ask for slightly larger buffers at every step; the
        caching allocator keeps the smaller freed blocks and maps new ones beside them, so the
        reserved VRAM creeps past the budget while the allocated VRAM stays inside it (measured:
        a 1440p image chat at 2 GiB allocated at most 1.6 GiB and reserved 3.5 GiB). Emptying
        the cache costs a synchronize and re-allocating one step's buffers; steps whose buffers
        repeat (decode) reserve no more than the step before and are left alone.
        """
        if self.gpu is None or self.simulated or not self.uses_gpu:
            return
        reserved = torch.cuda.memory_reserved(self.gpu) - self._vram_before
        pools = self.graphs.pool_bytes if self.graphs is not None else 0  # private to the graphs
        cached = reserved - (torch.cuda.memory_allocated(self.gpu) - self._vram_before) - pools
        grew = reserved > self._reserved_after_step + ALLOCATOR_SLACK
        self._reserved_after_step = reserved
        if cached <= ALLOCATOR_SLACK:
            return
        need = self.need
        over_plan = reserved > need.total + pools + ALLOCATOR_SLACK
        limit = self.budget if self.budget is not None else need.total + pools
        if over_plan or (grew and reserved + need.workspace > limit):
            torch.cuda.empty_cache()
            self._reserved_after_step = torch.cuda.memory_reserved(self.gpu) - self._vram_before

    def _after_oom(self, failure: str, attempt: int) -> None:
        """A step ran out of VRAM (another program took it faster than the budget said): let the
        handler make the executor smaller, then the step is run again. Retrying is safe: a step's KV
        writes land at the same positions with the same values the second time."""
        if self.gpu is not None and not self.simulated:
            torch.cuda.empty_cache()
        if self.oom_handler is None or attempt >= self.oom_retries:
            tried = f" after {attempt} re-plan(s)" if attempt else ""
            raise BudgetError(
                f"the GPU ran out of memory during a step{tried} (placement {self.plans.name}, planned "
                f"{format_bytes(self.need.total)}): another program holds the VRAM the budget counted on; "
                f"free VRAM or lower --vram ({failure})")
        log.warning("the GPU ran out of memory during a step (placement %s, planned %s): re-planning smaller "
                    "and running the step again (attempt %d of %d)", self.plans.name, format_bytes(self.need.total),
                    attempt + 1, self.oom_retries)
        self.oom_handler(failure)

    def _run_locked(self, sublayers: list, x: torch.Tensor, step, tokens: int, to_host: bool) -> torch.Tensor:
        start = time.perf_counter()
        placement, threads = self.plans.for_tokens(tokens)
        use_cpu_threads(self._tier_threads(threads))
        self.step_threads = torch.get_num_threads()
        self._worker_team = self.plans.worker_threads_for(tokens)
        self._tuned_tokens = None
        if self.sparing_core:
            # The host thread keeps a core beside the worker's team (run_ahead.largest_team), so the spared
            # core is the team's too. The steps beside a plan tell the tuner nothing of its teams: they run
            # the team it has taken, never one on trial, and it hears nothing of them.
            largest = run_ahead.largest_team(torch.get_num_threads())  # (the step's threads, set above)
            taken = self._team_tuner.teams().get(tokens) if self._team_tuner is not None else None
            self._worker_team = max(1, min(taken or self._worker_team or largest, largest - 1))
        elif self._team_tuner is not None:
            largest = run_ahead.largest_team(torch.get_num_threads())
            self._worker_team, self._tuned_tokens = self._team_tuner.team(tokens, self._worker_team, largest), tokens
            self.team_trial_steps += self._team_tuner.on_trial(tokens)
        where = placement.as_dict()
        if not self.uses_gpu or self.simulated:
            x = x.cpu()  # token ids a GPU sampled before a re-plan onto the CPU alone
            with self._staging_finished():
                for sublayer in sublayers:
                    if self.staging is not None and where[sublayer.name].stages_kv:
                        # A simulated GPU stages KV through a CPU cache: the same steps as on a GPU.
                        x = self.staging.run(sublayer, self.host[sublayer.name].views, x, step)
                    elif self.uses_gpu and where[sublayer.name].split:
                        x = self._simulate_ffn_split(sublayer, where[sublayer.name].cpu_pieces, x)
                    else:
                        x = self._on_cpu(sublayer, x, step)
            self.report = StepReport(time.perf_counter() - start)
            return x
        self._host_compute_s = self._host_wait_s = self._host_split_s = 0.0
        self._worker_parts = {}
        packing_before = self._packed.packing_s
        self._gpu_steps += 1
        copied_before = self.ring.bytes_copied if self.ring else 0
        if self.staging is not None:
            self.staging.reset_counters()
        cache_before = self.expert_cache.stats.copy() if self.expert_cache else CacheStats()
        if self.ring is not None:
            self.ring.set_order(_streamed(placement, sublayers))
        crossings = 0
        compute = self.compute_stream
        compute.wait_stream(torch.cuda.current_stream(self.gpu))  # KV caches, inputs made on the default stream
        # Decode steps: runs of resident sub-layers replay a CUDA graph (None / eager when not covered).
        runs = self.graphs.runs(placement, sublayers) if self.graphs is not None and isinstance(step, Step) \
            and tokens == step.num_seqs else {}
        with torch.cuda.stream(compute), self._staging_finished(), self._cpu_parts_finished():
            skip_to = 0
            for index, sublayer in enumerate(sublayers):
                if index < skip_to:
                    continue
                end = runs.get(index)
                if end is not None:
                    if x.device.type == "cpu" and sublayer.kind != "embed":
                        x = x.to(self.gpu, non_blocking=True)
                        crossings += 1
                    replayed = self.graphs.run(sublayers[index:end], x, step)
                    if replayed is not None:
                        x, skip_to = replayed, end
                        continue
                here = where[sublayer.name]
                if here.compute == "cpu":
                    began = time.perf_counter()
                    if x.device.type != "cpu":
                        x = x.cpu()  # waits for the GPU work queued so far
                        crossings += 1
                    computing = time.perf_counter()
                    x = self._on_cpu(sublayer, x, step)
                    self._on_host(began, computing)
                    continue
                if here.split:  # both devices; the output stays on the device of the input
                    x, crossed = self._run_ffn_split(sublayer, here.cpu_pieces, x, compute)
                    crossings += crossed
                    continue
                if x.device.type == "cpu":
                    crossings += sublayer.kind != "embed"
                    x = x.to(self.gpu, non_blocking=True)
                if here.home == "experts":
                    x, crossed = self._run_split(sublayer, here, x)
                    crossings += crossed
                    continue
                streamed = here.home == "stream" or here.coded  # (pinned coded: decoded into a slot)
                weights = self.ring.acquire(sublayer.name, compute) if streamed else self.resident[sublayer.name]
                if here.stages_kv:  # GPU attention over its host KV cache, staged through VRAM
                    x = self.staging.run(sublayer, weights, x, step)
                else:
                    x = sublayer.forward(weights, x, step)
                if streamed:
                    self.ring.release(compute)
            out = x.cpu() if to_host else x
        copied = (self.ring.bytes_copied if self.ring else 0) - copied_before
        cache = self.expert_cache.stats.minus(cache_before) if self.expert_cache else CacheStats()
        extra = {"placement": placement.name}
        if self._worker_parts.get("parts"):  # the run-ahead worker's parts of this step
            extra["worker_parts"] = self._worker_parts
        if self.staging is not None and (self.staging.bytes_in or self.staging.bytes_out):
            extra.update(kv_staged_in=self.staging.bytes_in, kv_written_back=self.staging.bytes_out)
        packing = self._packed.packing_s - packing_before  # one-time preparation, not the step's CPU work
        if packing:
            extra["packing_s"] = packing
        self.report = StepReport(time.perf_counter() - start, copied + cache.bytes_copied, crossings,
                                 extra, cache.hits, cache.misses, cache.evictions,
                                 max(0.0, self._host_compute_s - packing), self._host_wait_s,
                                 max(0.0, self._host_split_s - packing))
        return out

    @contextmanager
    def _staging_finished(self):
        """At the end of a step (or its failure), every staged KV write-back has landed in its host
        cache: the next step may read it on the CPU or stage it again."""
        try:
            yield
        finally:
            if self.staging is not None:
                self.staging.finish()

    @contextmanager
    def _cpu_parts_finished(self):
        """At the end of a step, every CPU part handed to the run-ahead worker is done (its host
        times counted); a failed one fails the step."""
        try:
            yield
        except BaseException:
            if self._run_ahead is not None:
                try:
                    self._run_ahead.drain()
                except Exception:  # noqa: BLE001 - the step's own error is the one to raise
                    log.exception("a CPU part failed in a step that failed")
            raise
        if self._run_ahead is not None:
            computing, waiting = self._run_ahead.drain()
            self._host_compute_s += computing
            self._host_wait_s += waiting
            self._worker_parts = self._run_ahead.last_parts
            if self._tuned_tokens is not None and self._team_tuner is not None and self._worker_parts.get("parts"):
                self._team_tuner.observe(self._tuned_tokens, self._worker_parts["team"], computing)

    def _ahead(self, dense: bool = False, rows: int = 0) -> run_ahead.RunAhead | None:
        """The run-ahead worker (made on the first split FFN that uses it), None where it is off (for
        split dense FFNs' CPU parts of ``rows`` rows, ``dense``: :func:`~run_ahead.takes_dense`, or for MoE
        layers' host experts)."""
        if dense and not run_ahead.takes_dense(rows, self.model.dtype):
            return None
        if self._run_ahead is None and not self._run_ahead_tried:
            self._run_ahead_tried = True
            if run_ahead.available() and not self.simulated:
                try:
                    self._run_ahead = run_ahead.RunAhead()
                except Exception as exc:  # noqa: BLE001 - the step runs the usual way instead
                    log.warning("run-ahead split steps are not available here: %s", exc)
                else:
                    weakref.finalize(self, self._run_ahead.close)
                    self._team_tuner = self._make_team_tuner()
        if self._run_ahead is not None:
            self._run_ahead.team = self._worker_team
        return self._run_ahead

    def worker_teams(self) -> dict[int, int]:
        """{step tokens: the run-ahead worker's team the tuning took for such steps} ({}: no tuning)."""
        return self._team_tuner.teams() if self._team_tuner is not None else {}

    @staticmethod
    def _make_team_tuner() -> team_tuner.TeamTuner | None:
        """The worker's team tuning (:mod:`.team_tuner`), where it is on, no team is forced, and the
        worker's work goes through the C kernels (their team is an argument: a compiled kernel might
        compile again for each team)."""
        if not team_tuner.ENABLED or run_ahead.FORCED_TEAM is not None or cpu_gemv.library() is None:
            return None
        return team_tuner.TeamTuner()

    def _on_cpu(self, sublayer, x: torch.Tensor, step) -> torch.Tensor:
        """``sublayer`` on the CPU from host memory (a dense FFN at many rows in the reused buffers)."""
        weights = self.host[sublayer.name].views
        if isinstance(sublayer, DenseFFN):
            if FFNBuffers.wanted(x.shape[0]) or self._packed.enabled or cpu_gemv.computes(x.shape[0]):
                return x + self._cpu_contribution(sublayer, weights, sublayer.norm(weights, x), sublayer.num_pieces)
            weights = self._down_copies.part(sublayer.name, sublayer.num_pieces, weights)  # (down row-major)
        if isinstance(sublayer, MoEFFN):
            return sublayer.forward(self._host_experts_of(sublayer), x, step)
        return sublayer.forward(weights, x, step)


    def _on_host(self, waiting: float, computing: float) -> None:
        """Count the host's time in CPU work (StepReport): blocked on the GPU from ``waiting`` until
        ``computing``, then computing until now (``time.perf_counter`` readings)."""
        self._host_wait_s += computing - waiting
        self._host_compute_s += time.perf_counter() - computing


    # ------------------------------------------------------------------ reporting
    def peak_vram(self) -> int:
        """Peak ``torch.cuda.max_memory_reserved`` since load, less what the process already
        held before (other engines), i.e. this engine's peak VRAM (0 without a GPU)."""
        if self.gpu is None or self.simulated:
            return 0
        return torch.cuda.max_memory_reserved(self.gpu) - self._vram_before

    def describe(self) -> str:
        text = f"{'; '.join(p.summary() for p in self.plans.placements)}; VRAM plan {format_bytes(self.need.total)} ({self.need.breakdown()})"
        if self.budget is not None:
            text += f" of budget {format_bytes(self.budget)}"
        return text


def _streamed(placement: Placement, sublayers: list) -> list[StreamItem]:
    """What ``placement`` streams of ``sublayers``, in run order (the ring's fill order): sub-layer
    names, and (name, cpu_pieces) for the GPU part of a split FFN; sub-layers pinned coded take their
    turn too (decoded into their slot)."""
    where = placement.as_dict()
    return [(s.name, where[s.name].cpu_pieces) if where[s.name].split else s.name
            for s in sublayers if where[s.name].home == "stream" or where[s.name].coded]
