"""The VRAM expert cache: routed experts of MoE layers kept in VRAM slots, one expert per slot.

After a layer's router has run, the layer asks for the experts its tokens go to
(:meth:`ExpertCache.fetch`); those already cached are handed out at once, the others are
copied in on the copy stream (evicting by the policy), and the layer computes the
cached ones while the copies of the others are on their way. The cache knows nothing of
CUDA: a *copier* (``vramshard.runtime.streaming.ExpertSlots`` on the GPU, a fake in tests)
moves the bytes and orders the streams.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass
from typing import Hashable, Iterator, Mapping, Protocol

import torch

from ..layers.moe import ExpertTensors, ExpertWeights, Gathered, StackedExperts

Key = tuple[str, int]  # (sub-layer name, expert)


class ExpertCopier(Protocol):
    """Moves experts into cache slots and orders copy and compute (the mechanism under the cache)."""

    def fill(self, slot: int, name: str, expert: int) -> int:
        """Start copying ``expert`` of ``name`` into ``slot`` once its last reader is done; bytes moved."""

    def ready(self, slot: int) -> None:
        """Make the compute that follows wait until ``slot`` is filled."""

    def done(self, slot: int) -> None:
        """The compute reading ``slot`` is queued: a later fill may overwrite it after that compute."""

    # Optional: ``done_many(slots)``, ``done`` for several slots read by the same compute at once.

    def view(self, slot: int, name: str) -> ExpertTensors:
        """The expert weights in ``slot``, laid out as ``name``'s experts."""

    # Optional: ``stacked(name) -> StackedExperts | None``, every slot as one row of strided views
    # (slots at one stride in one buffer), so a step can read all its experts with a few kernels.


class FrequencyRecency:
    """Eviction policy: a key's score is the sum over its uses of 2^(t / half_life), t the clock
    of uses, i.e. a use frequency that decays with age (LRFU). The victim is the cached key
    with the lowest score. Scores are kept relative to one epoch, so their order never
    changes with time and a heap finds the victim (stale heap entries are skipped)."""

    def __init__(self, half_life: float):
        self.half_life = max(half_life, 1.0)
        self.clock = 0
        self._epoch = 0
        self.score: dict[Hashable, float] = {}
        self.cached: set[Hashable] = set()
        self._heap: list[tuple[float, int, Hashable]] = []
        self._tie = itertools.count()

    def touch(self, key: Hashable) -> None:
        """One use of ``key``."""
        self.clock += 1
        weight = 2.0 ** ((self.clock - self._epoch) / self.half_life)
        if weight > 1e200:
            self._rescale()
            weight = 1.0
        self.score[key] = self.score.get(key, 0.0) + weight
        if key in self.cached:
            self._push(key)

    def insert(self, key: Hashable) -> None:
        self.cached.add(key)
        self._push(key)

    def remove(self, key: Hashable) -> None:
        self.cached.discard(key)

    def victim(self, protected: set) -> Hashable | None:
        """The cached key to evict, never one in ``protected``; None when all are protected."""
        skipped, found = [], None
        while self._heap:
            entry = heapq.heappop(self._heap)
            score, _, key = entry
            if key not in self.cached or score != self.score.get(key, 0.0):
                continue  # stale
            if key in protected:
                skipped.append(entry)
                continue
            found = key
            break
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        if found is not None:
            self.cached.discard(found)
        return found

    def _push(self, key: Hashable) -> None:
        heapq.heappush(self._heap, (self.score.get(key, 0.0), next(self._tie), key))
        if len(self._heap) > 4 * len(self.cached) + 1024:
            self._rebuild()

    def _rebuild(self) -> None:
        self._heap = [(self.score.get(k, 0.0), next(self._tie), k) for k in self.cached]
        heapq.heapify(self._heap)

    def _rescale(self) -> None:
        factor = 2.0 ** ((self.clock - self._epoch) / self.half_life)
        self._epoch = self.clock
        self.score = {k: v / factor for k, v in self.score.items()}
        self._rebuild()


@dataclass
class CacheStats:
    """Counters since the cache was made: experts asked for that were cached (hits) or not."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_copied: int = 0
    elsewhere: int = 0  # misses computed from host memory (on the CPU) instead of copied in
    prefetched: int = 0  # experts copied in ahead of their step, on a guess (see ExpertCache.prefetch)
    prefetch_used: int = 0  # of those, the ones a step then asked for (counted as hits too)

    @property
    def hit_rate(self) -> float:
        asked = self.hits + self.misses
        return self.hits / asked if asked else 0.0

    def minus(self, before: "CacheStats") -> "CacheStats":
        return CacheStats(self.hits - before.hits, self.misses - before.misses, self.evictions - before.evictions,
                          self.bytes_copied - before.bytes_copied, self.elsewhere - before.elsewhere,
                          self.prefetched - before.prefetched, self.prefetch_used - before.prefetch_used)

    def copy(self) -> "CacheStats":
        return CacheStats(self.hits, self.misses, self.evictions, self.bytes_copied, self.elsewhere,
                          self.prefetched, self.prefetch_used)


class ExpertCache:
    """``capacity`` slots of one expert each, shared by every MoE layer that caches experts."""

    def __init__(self, capacity: int, copier: ExpertCopier, half_life: float | None = None):
        if capacity < 1:
            raise ValueError("an expert cache needs at least one slot")
        self.capacity = capacity
        self.copier = copier
        self.policy = FrequencyRecency(half_life or capacity)
        self.slot_of: dict[Key, int] = {}
        self.version = 0  # counts the changes of slot_of (kernels that read slots by table follow it)
        self._free = list(range(capacity - 1, -1, -1))
        self._guessed: set[Key] = set()  # prefetched, not yet asked for
        self.stats = CacheStats()

    def __contains__(self, key: Key) -> bool:
        return key in self.slot_of

    def fetch(self, name: str, ids: list[int]) -> Iterator[tuple[int, ExpertTensors]]:
        """Yield (expert, weights) for each of ``ids``: cached ones first, while the others are
        copied in. A yielded slot may be refilled once the next item is asked for."""
        hits = [e for e in ids if (name, e) in self.slot_of]
        misses = [e for e in ids if (name, e) not in self.slot_of]
        for e in ids:
            self.policy.touch((name, e))
        self._note_guesses(name, hits)
        self.stats.hits += len(hits)
        self.stats.misses += len(misses)
        protected = {(name, e) for e in ids}  # not evictable before they are used
        to_copy = deque(misses)
        self._issue(name, to_copy, protected)
        for expert in hits + misses:
            if (name, expert) not in self.slot_of:
                self._issue(name, to_copy, protected)  # a slot freed by the last use
            assert (name, expert) in self.slot_of, "expert cache: no slot to copy into"
            slot = self.slot_of[(name, expert)]
            self.copier.ready(slot)
            yield expert, self.copier.view(slot, name)
            self.copier.done(slot)
            protected.discard((name, expert))
            self._issue(name, to_copy, protected)

    def gather(self, name: str, ids: list[int]) -> dict[int, int] | None:
        """Make every expert of ``ids`` cached at once (copying the missing ones) and order the
        compute that follows after their copies. Returns expert -> slot, or None (nothing done)
        when ``ids`` do not all fit. Call :meth:`release` with the slots once the compute reading
        them is queued."""
        if len(ids) > self.capacity:
            return None
        protected = {(name, e) for e in ids}
        misses = [e for e in ids if (name, e) not in self.slot_of]
        for e in ids:
            self.policy.touch((name, e))
        self._note_guesses(name, [e for e in ids if (name, e) in self.slot_of])
        self.stats.hits += len(ids) - len(misses)
        self.stats.misses += len(misses)
        self._issue(name, deque(misses), protected)
        slots = {e: self.slot_of[(name, e)] for e in ids}
        for slot in slots.values():
            self.copier.ready(slot)
        return slots

    def prefetch(self, name: str, ids: list[int]) -> int:
        """Start copying the experts of ``ids`` not cached: a guess at a coming step's routing (the
        next layer's router applied to this layer's input), so that step finds them cached while
        the copies ran beside the compute before it. No hit, miss or use is counted; the experts
        the policy values least make room, never one this call brings in. Returns how many
        copies were started (at most the cache's capacity)."""
        guessed = [e for e in dict.fromkeys(ids) if (name, e) not in self.slot_of][: self.capacity]
        waiting = deque(guessed)
        self._issue(name, waiting, {(name, e) for e in guessed})
        started = guessed[: len(guessed) - len(waiting)]
        self._guessed.update((name, e) for e in started)
        self.stats.prefetched += len(started)
        return len(started)

    def warm(self, names: list[str], num_experts: int) -> int:
        """Fill the free slots before any step: the same number of experts of each layer in
        ``names`` (layer by layer in turn, experts in id order), so that decoding starts at the
        hit rate of a full cache (under uniform routing, its share of the experts) instead of
        climbing to it as steps fill it. Nothing counts as a use, hit or miss: the warmed experts
        have the policy's lowest score, the first to make room for experts the routers pick.
        Returns how many copies were started."""
        started = 0
        for expert in range(num_experts):
            for name in names:
                if not self._free:
                    return started
                if (name, expert) in self.slot_of:
                    continue
                self._put(self._free.pop(), name, expert)
                started += 1
        return started

    def _note_guesses(self, name: str, cached: list[int]) -> None:
        used = self._guessed.intersection((name, e) for e in cached)
        self.stats.prefetch_used += len(used)
        self._guessed -= used

    def slots_of(self, name: str, num_experts: int) -> list[int]:
        """The slot of each of ``name``'s experts, -1 where it is not cached."""
        return [self.slot_of.get((name, e), -1) for e in range(num_experts)]

    def least_used(self, name: str, ids: list[int], count: int) -> list[int]:
        """The ``count`` experts of ``ids`` that the policy values least (ties: lower id first)."""
        score = self.policy.score
        return sorted(ids, key=lambda e: (score.get((name, e), 0.0), e))[: max(0, count)]

    def note_computed_elsewhere(self, name: str, ids: list[int]) -> None:
        """``ids`` were used this step but computed without the cache: they count as uses (for the
        policy) and as misses."""
        for e in ids:
            self.policy.touch((name, e))
        self.stats.misses += len(ids)
        self.stats.elsewhere += len(ids)

    def release(self, slots) -> None:
        """The compute reading ``slots`` is queued: they may be refilled after it."""
        many = getattr(self.copier, "done_many", None)
        if many is not None:
            many(list(slots))  # one mark after the compute, for all of them
            return
        for slot in slots:
            self.copier.done(slot)

    def _issue(self, name: str, to_copy: deque, protected: set) -> None:
        """Start the copies of as many waiting experts as there are slots to put them in."""
        while to_copy:
            slot = self._take_slot(protected)
            if slot is None:
                return  # every slot holds an expert still to be used: more after the next use
            self._put(slot, name, to_copy.popleft())

    def _put(self, slot: int, name: str, expert: int) -> None:
        """Start copying ``expert`` of ``name`` into the free ``slot`` and hold it there."""
        self.stats.bytes_copied += self.copier.fill(slot, name, expert)
        self.slot_of[(name, expert)] = slot
        self.version += 1
        self.policy.insert((name, expert))

    def _take_slot(self, protected: set) -> int | None:
        if self._free:
            return self._free.pop()
        victim = self.policy.victim(protected)
        if victim is None:
            return None
        self.stats.evictions += 1
        self._guessed.discard(victim)
        self.version += 1
        return self.slot_of.pop(victim)


class CachedExperts(ExpertWeights):
    """Expert source of one MoE sub-layer whose experts come through the :class:`ExpertCache`;
    its own weights (norm, router) are ``main``, resident in VRAM."""

    def __init__(self, main: Mapping[str, torch.Tensor], name: str, cache: ExpertCache):
        self.main = main
        self.name = name
        self.cache = cache

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.main[key]

    def __iter__(self):
        return iter(self.main)

    def __len__(self) -> int:
        return len(self.main)

    def experts(self, ids: list[int]) -> Iterator[tuple[int, ExpertTensors]]:
        return self.cache.fetch(self.name, ids)

    def stacked(self) -> StackedExperts | None:
        return None

    def gather(self, ids: list[int]) -> Gathered | None:
        """The experts ``ids`` as rows of the cache's slots, all copied in first (where the copier
        lays its slots out at one stride and the cache holds them all)."""
        stacked = getattr(self.cache.copier, "stacked", None)
        stacked = stacked(self.name) if stacked is not None else None
        if stacked is None:
            return None
        slots = self.cache.gather(self.name, ids)
        if slots is None:
            return None
        return Gathered(stacked, slots, lambda: self.cache.release(slots.values()))


def cache_slots(cache_bytes: int, slot_bytes: int) -> int:
    """Slots of ``slot_bytes`` that ``cache_bytes`` hold (at least one)."""
    return max(1, cache_bytes // max(slot_bytes, 1))
