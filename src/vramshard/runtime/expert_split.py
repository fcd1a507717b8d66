"""The executor's MoE FFNs split at their experts (a mixin of :class:`~.executor.Executor`).

Home ``experts``: the main piece (norm, router, any shared expert) lies in one VRAM buffer with
the other split layers' (loaded once, :meth:`ExpertSplitSteps._load_split`); after the router ran,
the routed experts run on the CPU (the routed hidden states cross to the host and back, on the
host thread or the run-ahead worker), are read by the GPU's kernels straight from pinned host
memory (a few rows, ``VRAMSHARD_EXPERTS_ZERO_COPY``), shared between those kernels and the CPU, or
come through the VRAM expert cache (:mod:`~vramshard.runtime.expert_cache`), which copies only the
routed experts it lacks. The state (``split_weights``, ``host_experts``, ``expert_cache`` ...) is the
executor's own.
"""

from __future__ import annotations

import logging
import time

import torch

from ..errors import BudgetError, InvalidInputError
from ..layers.moe import GATHER_BYTES, DictExperts, MoEFFN, Routing, StackedExperts
from ..plan.memory import align, expert_slot_bytes
from ..plan.placement import TieredPlacement, Where
from ..units import format_bytes
from . import run_ahead, zero_copy_experts
from .expert_cache import CachedExperts, ExpertCache, cache_slots
from .streaming import ExpertSlots

log = logging.getLogger(__name__)


class ExpertSplitSteps:
    """MoE FFNs split at their experts: loading their main pieces and running their steps."""

    def _expert_split(self, plans: TieredPlacement) -> set[str]:
        names = {n for p in plans.placements for n in p.expert_names()}
        wrong = sorted(n for n in names if not isinstance(self.model[n], MoEFFN))
        if wrong:
            raise InvalidInputError(f"placement {plans.name} splits {', '.join(wrong[:3])} at its experts, "
                                    "but only Mixture-of-Experts FFN sub-layers have experts")
        return names

    def _expert_cache_bytes(self, plans: TieredPlacement, split: set[str], asked: int | None) -> int:
        if not any(p.expert_names("cache") for p in plans.placements):
            return 0
        slot = expert_slot_bytes(self.model)
        if asked is None:
            asked = plans.expert_cache or 2 * max(self.model[n].top_k for n in split) * slot
        if asked < slot:
            raise BudgetError(f"an expert cache of {format_bytes(asked)} holds no expert of "
                              f"{format_bytes(slot)}; give it at least {format_bytes(slot)}")
        return cache_slots(asked, slot) * slot

    def _load_split(self) -> None:
        """Main pieces (norm, router, any shared expert) of split MoE sub-layers into VRAM; host
        expert sources; the cache.

        The main pieces share one VRAM buffer (as counted by ``split_router_bytes``): a router alone
        is about half a MiB (Qwen3-MoE), and separate allocations that small would each take a slice
        of a 2 MiB segment."""
        if not self.split:
            return
        cached = {n for p in self.plans.placements for n in p.expert_names("cache")}
        on_host = {n for p in self.plans.placements for n in p.expert_names("host")}  # experts computed from host memory
        if cached:
            slot = expert_slot_bytes(self.model)
            copier = ExpertSlots(self.expert_cache_bytes // slot, slot, self.host, self.gpu, self.copy_stream)
            self.expert_cache = ExpertCache(self.expert_cache_bytes // slot, copier)
        names = sorted(self.split, key=lambda n: self.model[n].layer)
        in_order = [n for n in names if n in cached]
        if self.expert_cache is not None and in_order:  # copied beside the routers; _load_vram waits for both
            warmed = self.expert_cache.warm(in_order, max(self.model[n].num_experts for n in in_order))
            self.expert_cache.stats.bytes_copied = 0  # the load's copies, not a step's
            log.info("expert cache: %d of %d slots filled at load", warmed, self.expert_cache.capacity)
        self._next_cached = dict(zip(in_order, in_order[1:]))
        ranges = {name: self.host[name].layout.piece_range("main") for name in names}
        total = sum(align(end - begin) for begin, end in ranges.values())
        self._router_buffer = torch.empty(total, dtype=torch.uint8, device=self.gpu)
        cursor = 0
        for name in names:
            packed = self.host[name]
            begin, end = ranges[name]
            block = self._router_buffer[cursor : cursor + end - begin]
            block.copy_(packed.buffer[begin:end], non_blocking=True)
            cursor += align(end - begin)
            main = packed.layout.views(block, piece="main")
            self.split_weights[name] = CachedExperts(main, name, self.expert_cache) if name in cached else main
            self.host_experts[name] = self._host_experts_of(self.model[name])
            if name in on_host | cached and self.experts_zero_copy and zero_copy_experts.supported() \
                    and not self.simulated and packed.buffer.is_pinned():
                stacked = self.host_experts[name].stacked()
                if stacked is not None:
                    self._host_stacked[name] = stacked

    def _run_split(self, sublayer: MoEFFN, here: Where, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """A MoE FFN split at its experts: norm and router on the GPU, then the routed experts on
        the CPU (hidden states there and back), read by the GPU from pinned host memory (a few
        rows, ``VRAMSHARD_EXPERTS_ZERO_COPY``) or from the VRAM expert cache. A shared expert, in
        the main piece, runs on the GPU with the router. Returns (x, crossings)."""
        main = self.split_weights[sublayer.name]
        h, routing = sublayer.prepare(main, x)
        x = sublayer.with_shared(main, x, h)  # queued before the routed experts' crossings (a few kernels)
        if here.experts == "host":
            stacked = self._host_stacked.get(sublayer.name)
            if stacked is not None and h.shape[0] <= zero_copy_experts.ROWS:  # read by the GPU from host memory
                share = self.zero_copy_share(h.shape[0])
                if share:
                    return self._run_zero_copy(sublayer, stacked, h, routing, x, share)
                return x + zero_copy_experts.routed_experts(stacked, h, routing), 0
            ahead = self._ahead()
            if ahead is not None:
                return x + self._experts_ahead(ahead, sublayer, h, routing), 2
            began = time.perf_counter()
            h_host, routing_host = h.cpu(), routing.to(torch.device("cpu"))  # waits for the router
            computing = time.perf_counter()
            y = sublayer.run_experts(self.host_experts[sublayer.name], h_host, routing_host)
            self._on_host(began, computing)
            return x + y.to(self.gpu, non_blocking=True), 2
        stacked = self._host_stacked.get(sublayer.name)
        refresh = self._gpu_steps % zero_copy_experts.REFRESH_STEPS == 0  # this step copies its misses in
        if stacked is not None and h.shape[0] <= zero_copy_experts.ROWS and self.expert_cache is not None \
                and not refresh:
            cache = self._cache_source(sublayer)  # hits from their slots, misses from host memory
            if cache is not None:
                y = zero_copy_experts.routed_experts(stacked, h, routing, cache)
                self.expert_cache.copier.read_by_table()
                return x + y, 0
        small = routing.experts.numel() * sublayer.expert_bytes <= GATHER_BYTES
        if self.expert_cpu_share and self.expert_cache is not None and small:
            return self._run_hybrid(sublayer, h, routing, x)
        if self.expert_prefetch and self.expert_cache is not None and small:
            return self._run_cached(sublayer, h, routing, x)
        source = self.split_weights[sublayer.name]
        if stacked is not None and isinstance(source, CachedExperts) and h.shape[0] <= zero_copy_experts.CACHED_ROWS:
            y = zero_copy_experts.routed_through_cache(stacked, h, routing, source.gather)
            if y is not None:  # (None: more experts than the cache holds at once)
                return x + y, 0
        return x + sublayer.run_experts(self.split_weights[sublayer.name], h, routing), 0

    def zero_copy_share(self, n_tokens: int) -> float:
        """The CPU's share of a step's zero-copy experts: the executor's own, else the plan's tier's."""
        if self.zero_copy_cpu_share is not None:
            return self.zero_copy_cpu_share
        return self.plans.zero_copy_cpu_share(n_tokens)

    def _run_zero_copy(self, sublayer: MoEFFN, stacked: StackedExperts, h: torch.Tensor, routing,
                       x: torch.Tensor, share: float) -> tuple[torch.Tensor, int]:
        """A decode-sized step's host experts shared: the GPU's kernels read some from pinned memory
        while the CPU computes the others: each token's first ``cpu_expert_count(share, top_k)``
        experts (in routing order) go to the CPU, the rest to the kernels.

        The split is by position, so the GPU marks the CPU's assignments -1 itself and the kernels
        over the rest are queued before the host waits for the router: the GPU reads its share while
        the routing and hidden states come over and the CPU computes its own. The CPU's sum goes
        back to be added. (Splitting by expert, as first built, needed the routing on the host
        before the kernels could be queued: the GPU sat idle through every layer's round trip, and
        the fourteenth GPU session measured the share slower than the kernels alone.)

        With the run-ahead worker (``VRAMSHARD_RUN_AHEAD``) the host does not wait at all: the
        worker computes the CPU's share once its inputs have landed, and the GPU's stream waits for
        its result before adding it, the next layers already queued behind. (The sixteenth GPU
        session's step profile of the host-thread way: 6.0 ms of the CPU's share and 3.3 ms of
        waiting for the router in an 18.4 ms step whose kernels took 9.8: the GPU sat idle while
        the host computed, the next layer not yet queued. On the worker the same 8-layer step took
        13.49 ms against 14.38 for the kernels alone; the worker's share took 9.0 ms, against 5.9
        on the host thread.)"""
        began = time.perf_counter()
        top_k = routing.experts.shape[1]
        on_cpu = zero_copy_experts.cpu_expert_count(share, top_k)
        ahead = self._ahead() if on_cpu else None
        if on_cpu:  # the CPU's inputs cross first: its wait below covers the router and them only
            mine = Routing(routing.experts[:, :on_cpu], routing.weights[:, :on_cpu])
            h_host, routing_host = h.to("cpu", non_blocking=True), mine.to(torch.device("cpu"), non_blocking=True)
            if ahead is not None:
                number = ahead.copied()  # the worker starts as soon as these have landed
            else:
                crossed = torch.cuda.Event()
                crossed.record()
        if on_cpu < top_k:  # the kernels' share, queued before the host waits
            marked = routing.experts.clone()
            marked[:, :on_cpu] = -1
            x = x + zero_copy_experts.routed_experts(stacked, h, Routing(marked, routing.weights))
        if not on_cpu:
            return x, 0
        if ahead is not None:
            source = self.host_experts[sublayer.name]
            y = ahead.result_on(self.gpu, number, h_host,
                                lambda out: out.copy_(sublayer.run_experts(source, h_host, routing_host)),
                                lambda out: sublayer.experts_part(source, h_host, routing_host, out))
            return x + y, 2
        crossed.synchronize()  # the router and the copies (the kernels run on meanwhile)
        computing = time.perf_counter()
        y = sublayer.run_experts(self.host_experts[sublayer.name], h_host, routing_host)
        self._on_host(began, computing)
        return x + y.to(self.gpu, non_blocking=True), 2

    def _cache_source(self, sublayer: MoEFFN) -> zero_copy_experts.CachedSource | None:
        """The expert cache as the zero-copy kernels read it for ``sublayer``: its slots and the
        layer's slot table on the GPU, rebuilt when the cache has changed (steps too large for the
        kernels fill it); None where the copier does not lay its slots out at one stride."""
        cache = self.expert_cache
        slots = cache.copier.stacked(sublayer.name)
        if slots is None:
            return None
        version, table = self._slot_tables.get(sublayer.name, (-1, None))
        if version != cache.version:
            ids = cache.slots_of(sublayer.name, sublayer.num_experts)
            table = torch.tensor(ids, dtype=torch.int32).to(self.gpu)  # (a few hundred bytes, now and then)
            for slot in ids:
                if slot >= 0:
                    cache.copier.ready(slot)  # the stream waits for the slot's fill, once per fill
            self._slot_tables[sublayer.name] = (cache.version, table)
        return zero_copy_experts.CachedSource(slots, table)

    def _run_cached(self, sublayer: MoEFFN, h: torch.Tensor, routing, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """A decode-sized MoE step over the expert cache that also prefetches for the next one.

        The next cached MoE layer's norm and router, applied to this layer's input ``x``, guess
        its experts (the residual stream changes little in one layer). The guess comes to the
        host with this layer's routing, in the host sync that the step has anyway. The guessed
        experts not cached start copying once this layer's experts are queued, so the copies run
        beside this layer's compute and the next attention instead of after the next router.
        Returns (x, crossings)."""
        following = self._next_cached.get(sublayer.name)
        guess = arrived = None
        if following is not None:
            _, predicted = self.model[following].prepare(self.split_weights[following], x)
            guess = predicted.experts.to("cpu", non_blocking=True)  # queued before this layer's experts
            arrived = torch.cuda.Event()
            arrived.record()
        y = sublayer.run_experts(self.split_weights[sublayer.name], h, routing)  # reads its routing: a sync
        if guess is not None:
            arrived.synchronize()  # already done: the routing's sync came after it
            self.expert_cache.prefetch(following, sorted(set(guess.reshape(-1).tolist())))
        return x + y, 0

    def _run_hybrid(self, sublayer: MoEFFN, h: torch.Tensor, routing, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """A decode-sized MoE step over the expert cache: of the experts not cached, the share
        ``expert_cpu_share`` (the least used ones) is computed on the CPU from host memory while the
        others are copied in and computed on the GPU with the cached ones, so PCIe and the CPU work
        at once. Returns (x, crossings)."""
        name, cache = sublayer.name, self.expert_cache
        ids = sorted(set(routing.experts.reshape(-1).tolist()))  # host sync: the router is done
        misses = [e for e in ids if (name, e) not in cache]
        on_cpu = set(cache.least_used(name, misses, round(self.expert_cpu_share * len(misses))))
        if not on_cpu:
            return x + sublayer.run_experts(self.split_weights[name], h, routing), 0
        cpu = torch.device("cpu")
        began = time.perf_counter()
        h_host, routing_host = h.cpu(), routing.to(cpu)  # before the GPU share is queued: no wait on its copies
        self._host_wait_s += time.perf_counter() - began
        y = sublayer.run_experts(self.split_weights[name], h, routing, only=set(ids) - on_cpu)  # queued
        cache.note_computed_elsewhere(name, sorted(on_cpu))
        computing = time.perf_counter()
        y_host = sublayer.run_experts(self.host_experts[name], h_host, routing_host, only=on_cpu)
        self._host_compute_s += time.perf_counter() - computing
        return x + y + y_host.to(self.gpu, non_blocking=True), 2

    def _experts_ahead(self, ahead: run_ahead.RunAhead, sublayer: MoEFFN, h: torch.Tensor, routing) -> torch.Tensor:
        """A MoE layer's routed experts on the run-ahead worker, from host memory: the hidden
        states and the routing go to the host, the worker computes once they have landed; returns
        the result's copy on the GPU (nothing here waits)."""
        h_host = h.to("cpu", non_blocking=True)
        routing_host = routing.to(torch.device("cpu"), non_blocking=True)
        number = ahead.copied()
        source = self.host_experts[sublayer.name]
        return ahead.result_on(self.gpu, number, h_host,
                               lambda out: out.copy_(sublayer.run_experts(source, h_host, routing_host)),
                               lambda out: sublayer.experts_part(source, h_host, routing_host, out))

    def _host_experts_of(self, sublayer: MoEFFN) -> DictExperts:
        """A MoE sub-layer's experts in its host buffer, stacked where they lie at one stride (made once)."""
        source = self._host_moe.get(sublayer.name)
        if source is None:
            source = DictExperts(self.host[sublayer.name].views, sublayer.num_experts, stack=True)
            self._host_moe[sublayer.name] = source
        return source
