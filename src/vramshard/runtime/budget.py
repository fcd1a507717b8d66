"""VRAM budgets that change while the model runs: where the budget comes from, and what to run under it.

Sources (what the budget is now):
  :class:`FixedBudget`     a size given once;
  :class:`SettableBudget`  a size any thread may change (``Engine.set_vram``, ``POST /v1/budget``);
  :class:`AutoBudget`      the free VRAM plus what this process already holds, less a safety margin
                           (read through NVML when ``pynvml`` / ``nvidia-ml-py`` is importable, else
                           ``torch.cuda.mem_get_info``), read at most every ``min_interval_s``.

A :class:`BudgetWatcher` is polled by the engine at step boundaries and says when the budget in
force should change. :func:`adapt_plan` decides what to run under a new budget (the new plan, the
sub-layers to unpin and pin, where the KV cache goes) from plan data alone, so it is tested without
a GPU; the executor's ``reconfigure`` then applies it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from ..errors import BudgetError, InvalidInputError
from ..models.base import Model
from ..plan.memory import VramNeed
from ..plan.placement import CPU, Placement
from ..plan import planner as planner_module
from ..plan.mechanisms import Mechanisms, fixed_mechanisms
from ..plan.planner import PlanSet, Planner, TierPlan
from ..plan.tiers import Tiers
from ..units import AUTO, auto_margin, format_bytes, is_auto, parse_size

log = logging.getLogger(__name__)

AUTO_POLL_S = 0.5  # an auto budget reads the free VRAM at most this often
AUTO_TOLERANCE_BYTES = 256 * 2**20  # an auto budget that moves less than this (or 5%) changes nothing ...
AUTO_TOLERANCE_FRACTION = 0.05  # ... unless it falls below what the plan needs
OOM_MARGIN_BYTES = 256 * 2**20  # after an out-of-memory error, re-plan this much below what was held
PLAN_CACHE_SIZE = 16


# ---------------------------------------------------------------------- parsing
def parse_vram(value) -> int | str | None:
    """A budget as ``set_vram`` and ``POST /v1/budget`` take it: bytes, a size (``"4GiB"``),
    ``"auto"`` (returns :data:`~vramshard.units.AUTO`) or None / ``"none"`` (no limit)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise InvalidInputError(f"a VRAM budget is a size such as 4GiB, 'auto' or 'none', got {value!r}")
    if is_auto(value):
        return AUTO
    if isinstance(value, str) and value.strip().lower() in ("none", "unlimited"):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidInputError(f"a VRAM budget must be a finite size, got {value!r}")
    if isinstance(value, (int, float)) and value < 0:
        raise InvalidInputError(f"a VRAM budget must not be negative, got {value}")
    if not isinstance(value, (int, float, str)):
        raise InvalidInputError(f"a VRAM budget is a size such as 4GiB, 'auto' or 'none', got {value!r}")
    return parse_size(value)


# ---------------------------------------------------------------------- reading VRAM
def _nvml():
    """The NVML module, initialised, or None when pynvml / nvidia-ml-py is missing or fails."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver, no permission: fall back to CUDA's own count
        return None
    return pynvml


def _nvml_handle(nvml, device):
    import torch

    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    try:  # CUDA_VISIBLE_DEVICES may renumber devices: match by UUID
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        return nvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    except Exception:
        return nvml.nvmlDeviceGetHandleByIndex(index)


def free_vram(device="cuda") -> tuple[int, int]:
    """(free, total) bytes of VRAM on ``device``, all processes counted (NVML, else CUDA)."""
    import torch

    nvml = _nvml()
    if nvml is not None:
        try:
            info = nvml.nvmlDeviceGetMemoryInfo(_nvml_handle(nvml, device))
            return int(info.free), int(info.total)
        except Exception as exc:  # an NVML that cannot see this device: CUDA can
            log.debug("NVML memory read failed (%s); using torch.cuda.mem_get_info", exc)
    free, total = torch.cuda.mem_get_info(torch.device(device))
    return int(free), int(total)


def process_vram(pid: int, device="cuda") -> int | None:
    """VRAM used by process ``pid`` on ``device`` as NVML reports it (None without NVML)."""
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        handle = _nvml_handle(nvml, device)
        for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == pid:
                return int(proc.usedGpuMemory or 0)
    except Exception:
        return None
    return 0


# ---------------------------------------------------------------------- sources
class BudgetSource(Protocol):
    """Where the budget comes from. ``read()``: bytes, or None for no limit. ``min_interval_s``:
    the watcher reads it at most this often. ``changed_at``: ``time.monotonic()`` of the last
    explicit change (None for sources that drift, such as :class:`AutoBudget`)."""

    name: str
    min_interval_s: float

    def read(self) -> int | None: ...

    @property
    def changed_at(self) -> float | None: ...


class FixedBudget:
    """A budget that never changes."""

    name = "fixed"
    min_interval_s = 0.0

    def __init__(self, nbytes: int | None):
        self.nbytes = nbytes
        self._created = time.monotonic()

    def read(self) -> int | None:
        return self.nbytes

    @property
    def changed_at(self) -> float | None:
        return self._created


class SettableBudget:
    """A budget any thread may change with :meth:`set`; read every poll (a lock and an int)."""

    name = "set"
    min_interval_s = 0.0

    def __init__(self, nbytes: int | None):
        self._lock = threading.Lock()
        self._value = nbytes
        self._changed = time.monotonic()

    def set(self, nbytes: int | None) -> None:
        with self._lock:
            self._value = nbytes
            self._changed = time.monotonic()

    def read(self) -> int | None:
        with self._lock:
            return self._value

    @property
    def changed_at(self) -> float | None:
        with self._lock:
            return self._changed


class AutoBudget:
    """The free VRAM plus what this process holds already, less a safety margin (``--vram auto``).

    reader: () -> (free, total) bytes (default :func:`free_vram`); held: () -> bytes this process
    holds (default ``torch.cuda.memory_reserved``) — both replaceable to simulate another program.
    """

    name = "auto"

    def __init__(self, device="cuda", margin: int | None = None, reader: Callable[[], tuple[int, int]] | None = None,
                 held: Callable[[], int] | None = None, min_interval_s: float = AUTO_POLL_S):
        self.device = device
        self.margin = margin
        self.min_interval_s = min_interval_s
        self._reader = reader or (lambda: free_vram(device))
        self._held = held or self._reserved

    def _reserved(self) -> int:
        import torch

        return int(torch.cuda.memory_reserved(torch.device(self.device))) if torch.cuda.is_available() else 0

    def read(self) -> int | None:
        free, total = self._reader()
        margin = auto_margin(total) if self.margin is None else self.margin
        return max(0, free + self._held() - margin)

    @property
    def changed_at(self) -> float | None:
        return None


@dataclass(frozen=True)
class BudgetChange:
    """A budget the engine should adapt to: ``budget`` bytes (None: no limit), asked for at
    ``requested_at`` (``time.monotonic()``; the start of the time to adapt)."""

    budget: int | None
    requested_at: float
    source: str


class BudgetWatcher:
    """Says, when polled at a step boundary, whether the budget in force should change.

    Explicit sources (fixed, set) count every change. An auto budget is read at most every
    ``source.min_interval_s`` and ignores moves within ``AUTO_TOLERANCE_*`` unless it drops
    below ``need`` (what the plan in force needs). After an out-of-memory error, :meth:`lower`
    puts a ceiling under the source until the source changes (a new ``set_vram``, or an auto
    reading that grew past the tolerance).
    """

    def __init__(self, source: BudgetSource, in_force: int | None, clock: Callable[[], float] = time.monotonic):
        self._lock = threading.Lock()
        self._clock = clock
        self._source = source
        self.in_force = in_force
        self._last_read = -math.inf
        self._seen_change = source.changed_at
        self._ceiling: tuple[int, int | None] | None = None  # (bytes, the source's reading then)

    @property
    def source(self) -> BudgetSource:
        return self._source

    def set_source(self, source: BudgetSource) -> None:
        """Follow another source from the next poll on (any thread)."""
        with self._lock:
            self._source = source
            self._last_read = -math.inf
            self._seen_change = None
            self._ceiling = None

    def lower(self, nbytes: int) -> None:
        """A ceiling under the source (after an out-of-memory error); :meth:`poll` applies it."""
        with self._lock:
            self._ceiling = (nbytes, self._safe_read())
            self._last_read = -math.inf

    def _safe_read(self) -> int | None:
        try:
            return self._source.read()
        except Exception:
            return None

    def accept(self, budget: int | None) -> None:
        """The engine now runs under ``budget``."""
        with self._lock:
            self.in_force = budget

    def poll(self, need: int | None = None) -> BudgetChange | None:
        """A :class:`BudgetChange` when the engine should re-plan, else None (cheap)."""
        with self._lock:
            source = self._source
            now = self._clock()
            if now - self._last_read < source.min_interval_s:
                return None
            self._last_read = now
            raw = source.read()
            value = raw
            changed_at = source.changed_at
            explicit = changed_at is not None
            fresh = explicit and changed_at != self._seen_change  # set since the last poll
            if fresh:
                self._seen_change = changed_at
                self._ceiling = None  # a budget set after the out-of-memory error replaces its ceiling
            if self._ceiling is not None:
                ceiling, raw_then = self._ceiling
                grew = raw is not None and raw_then is not None and raw > raw_then + _tolerance(raw_then)
                if grew or (raw is None and raw_then is not None):
                    self._ceiling = None
                else:
                    value = ceiling if raw is None else min(raw, ceiling)
            if fresh and value != self.in_force:
                return BudgetChange(value, changed_at, source.name)
            if value == self.in_force:
                return None
            if explicit or value is None or self.in_force is None:
                return BudgetChange(value, now, source.name)
            must_shrink = need is not None and value < need
            if not must_shrink and abs(value - self.in_force) <= _tolerance(self.in_force):
                return None
            return BudgetChange(value, now, source.name)


def _tolerance(nbytes: int) -> float:
    return max(AUTO_TOLERANCE_BYTES, AUTO_TOLERANCE_FRACTION * nbytes)


def budget_after_oom(need_total: int, held: int, free: int = 0, margin: int | None = None) -> int:
    """The budget to re-plan under after a step ran out of VRAM: what this process held plus what
    is free now, at most the plan's need, less a margin (so the new plan is strictly smaller)."""
    if margin is None:
        margin = max(1, min(OOM_MARGIN_BYTES, need_total // 8))
    return max(0, min(need_total, held + free) - margin)


# ---------------------------------------------------------------------- re-planning
@dataclass(frozen=True)
class PlanSettings:
    """What the planner needs besides the budget; fixed for the life of an engine."""

    profile: object  # vramshard.profile.Profile
    tiers: Tiers
    context: int  # KV positions reserved (the engine's kv_tokens)
    num_slots: int = 2
    name: str = "model"
    split_ffns: bool = True  # the host packing lets plans split dense FFNs between the CPU and the GPU
    # whether plans may split the KV cache by layer (None: VRAMSHARD_KV_SPLIT as this process read it)
    kv_split: bool | None = None
    # whether this engine's stream fills cross the link coded (None: VRAMSHARD_WIRE_CODEC as this process reads
    # it; False where the host cannot hold the coded copies: wire_codec.holds_coded_copies)
    wire_codec: bool | None = None
    # whether this engine replays decode steps from CUDA graphs (None: as an engine in this process would by
    # default, mechanisms.decode_graphs_enabled)
    decode_graphs: bool | None = None

    def splits_kv(self) -> bool:
        """:attr:`kv_split`, None read as this process's switch (a planning process is told it)."""
        return planner_module.KV_SPLIT if self.kv_split is None else self.kv_split

    def mechanisms(self) -> Mechanisms:
        """The mechanisms this engine's plans price: this process's, with this engine's link codec and decode
        graphs."""
        mechanisms = Mechanisms.here()
        if self.wire_codec is not None:
            mechanisms = dataclasses.replace(mechanisms, wire_codec=self.wire_codec)
        if self.decode_graphs is not None:
            mechanisms = dataclasses.replace(mechanisms, decode_graphs=self.decode_graphs)
        return mechanisms

    def pricing(self):
        """A context in which estimators price :meth:`mechanisms` (a plan made in this process)."""
        own = self.wire_codec is not None or self.decode_graphs is not None
        return fixed_mechanisms(self.mechanisms()) if own else contextlib.nullcontext()


@dataclass(frozen=True)
class Adaptation:
    """What to run under a new budget and what changes on the way there."""

    budget: int | None
    plan: PlanSet
    unpin: tuple[str, ...]  # resident now, not in the new plan: their VRAM is released
    pin: tuple[str, ...]  # newly resident
    kv_to_host: bool  # KV caches move out of VRAM (attention of those layers then runs on the CPU)
    kv_to_gpu: bool
    quick: bool = False  # the plan was made without the per-sub-layer search (a full one should follow)

    @property
    def need(self) -> VramNeed:
        return self.plan.need

    def summary(self) -> str:
        kv = "; KV cache to host memory" if self.kv_to_host else "; KV cache back to VRAM" if self.kv_to_gpu else ""
        budget = "no limit" if self.budget is None else format_bytes(self.budget)
        return (f"budget {budget}: unpin {len(self.unpin)}, pin {len(self.pin)} sub-layer(s){kv}; "
                f"plan needs {format_bytes(self.plan.need.total)}")


def budget_key(budget: int | None) -> int | None:
    """``budget`` rounded down to about 1/1000 of its size (4 MiB of 4 GiB): budgets this close
    share one cached plan (rounding down keeps the plan within the budget)."""
    if budget is None:
        return None
    step = 1 << max(0, int(budget).bit_length() - 11)
    return budget // step * step


class PlanCache:
    """Plans by (rounded budget, forced KV location, searched), the most recent ``size`` kept: a
    budget that goes back and forth between a few values re-plans only once per value. Safe to
    share with a thread that plans in the background (plans are built outside the lock)."""

    def __init__(self, size: int = PLAN_CACHE_SIZE):
        self.size = size
        self._plans: dict[tuple, PlanSet] = {}
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def peek(self, key: tuple) -> PlanSet | None:
        """The plan cached under ``key``, if any (not counted as a hit or a miss)."""
        with self._lock:
            return self._plans.get(key)

    def get(self, key: tuple, build: Callable[[], PlanSet]) -> PlanSet:
        with self._lock:
            if key in self._plans:
                self.hits += 1
                self._plans[key] = self._plans.pop(key)  # most recent last
                return self._plans[key]
            self.misses += 1
        plan = build()
        self.put(key, plan)
        return plan

    def put(self, key: tuple, plan: PlanSet) -> None:
        with self._lock:
            self._plans.pop(key, None)
            self._plans[key] = plan
            while len(self._plans) > self.size:
                self._plans.pop(next(iter(self._plans)))


def cpu_plan_set(model: Model, settings: PlanSettings, budget: int | None, note: str) -> PlanSet:
    """Every sub-layer on the CPU (no VRAM at all), in the shape of a planned :class:`PlanSet`."""
    placement = Placement("cpu", tuple((s.name, CPU) for s in model))
    tiers = {t: TierPlan(t, "cpu", placement, None, 0.0, {"cpu": 0.0}, {"cpu": placement}) for t in settings.tiers.sizes}
    return PlanSet(settings.name, budget, settings.context, False, 0, VramNeed(0, 0, 0, 0), [], [], tiers, [note])


def make_plan(model: Model, settings: PlanSettings, budget: int | None, kv_on_gpu: bool | None = None,
              search: bool = True) -> PlanSet:
    """The planner's plan under ``budget`` bytes as they are (see :func:`plan_for_budget`), made here."""
    try:
        with settings.pricing():
            return Planner(model, settings.profile, budget, context=settings.context, tiers=settings.tiers,
                           num_slots=settings.num_slots, name=settings.name, kv_on_gpu=kv_on_gpu,
                           split_ffns=settings.split_ffns, search=search, kv_split=settings.splits_kv()).plan()
    except BudgetError as exc:
        if kv_on_gpu:
            raise
        return cpu_plan_set(model, settings, budget, f"nothing fits the budget on the GPU ({exc}); all on the CPU")


MakePlan = Callable[..., PlanSet]  # (model, settings, budget, kv_on_gpu, search), as make_plan


def plan_for_budget(model: Model, settings: PlanSettings, budget: int | None, kv_on_gpu: bool | None = None,
                    cache: PlanCache | None = None, search: bool = True, make: MakePlan = make_plan) -> PlanSet:
    """The plan to run under ``budget`` (rounded by :func:`budget_key`); all on the CPU when not
    even the planner's minimum fits. ``kv_on_gpu``: force the KV cache's side (None: planner's choice).
    ``search=False``: the planner's quick plan (no per-sub-layer search), unless the full plan
    for this budget is cached already. ``make``: what makes a plan not cached (:func:`make_plan`, or
    :meth:`~vramshard.runtime.plan_process.PlanProcess.make_plan` in a child process)."""
    key = budget_key(budget)

    def build() -> PlanSet:
        return make(model, settings, key, kv_on_gpu, search)

    if cache is None:
        return build()
    if not search and cache.peek((key, kv_on_gpu, True)) is not None:
        return cache.get((key, kv_on_gpu, True), build)
    return cache.get((key, kv_on_gpu, search), build)


def adapt_plan(model: Model, settings: PlanSettings, current: PlanSet | None, budget: int | None,
               live_kv_positions: int = 0, cache: PlanCache | None = None, search: bool = True) -> Adaptation:
    """What to run under ``budget``, from the plan in force (None: nothing planned yet).

    The KV cache goes where the planner wants it, except that live caches larger than the
    reservation (``settings.context`` positions; ``live_kv_positions``: positions of the caches
    now allocated) must stay in host memory. ``search=False``: a quick plan (see
    :func:`plan_for_budget`); ``Adaptation.quick`` says whether one was made.
    """
    kv_forced = forced_kv_side(live_kv_positions, settings)
    full = cache is not None and cache.peek((budget_key(budget), kv_forced, True)) is not None
    plan = plan_for_budget(model, settings, budget, kv_forced, cache, search)
    return adaptation_between(model, current, plan, budget,
                              quick=not search and not full and bool(plan.pinned or plan.need.total))


def forced_kv_side(live_kv_positions: int, settings: PlanSettings) -> bool | None:
    """False when the live KV caches (``live_kv_positions``) exceed the VRAM reservation and must
    stay in host memory; None: the planner chooses."""
    return False if live_kv_positions > settings.context else None


def adaptation_between(model: Model, current: PlanSet | None, plan: PlanSet, budget: int | None,
                       quick: bool = False) -> Adaptation:
    """Going from the plan in force (None: nothing planned yet) to ``plan`` under ``budget``."""
    before = set(current.pinned) if current is not None else set()
    after = set(plan.pinned)
    order = {s.name: i for i, s in enumerate(model)}
    was_on_gpu = bool(current is not None and current.kv_on_gpu)
    return Adaptation(budget, plan, tuple(sorted(before - after, key=order.__getitem__)),
                      tuple(sorted(after - before, key=order.__getitem__)),
                      kv_to_host=was_on_gpu and not plan.kv_on_gpu, kv_to_gpu=plan.kv_on_gpu and not was_on_gpu,
                      quick=quick)


def start_budget_thread(poll: Callable[[], object], interval_s: float = 1.0,
                        name: str = "vramshard-budget") -> threading.Event:
    """Call ``poll`` every ``interval_s`` on a daemon thread (a server idle between requests still
    gives VRAM back); set the returned event to stop it."""
    stop = threading.Event()

    def run():
        while not stop.wait(interval_s):
            try:
                poll()
            except Exception:  # keep watching: the next poll may succeed
                log.exception("budget poll failed")

    threading.Thread(target=run, name=name, daemon=True).start()
    return stop


__all__ = ["AUTO", "Adaptation", "AutoBudget", "adaptation_between", "forced_kv_side", "BudgetChange", "BudgetSource", "BudgetWatcher", "FixedBudget",
           "PlanCache", "PlanSettings", "SettableBudget", "adapt_plan", "budget_after_oom", "budget_key",
           "cpu_plan_set", "free_vram", "parse_vram", "plan_for_budget", "process_vram", "start_budget_thread"]
