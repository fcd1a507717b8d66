"""An engine following its VRAM budget while it runs.

The budget comes from a source (a fixed size, ``set_vram`` at run time, ``auto``: the free VRAM
less a margin) that a :class:`~vramshard.runtime.budget.BudgetWatcher` reads at step boundaries.
When it changes, the language model is re-planned under it (a vision-language model with room
for its vision phase beside it) and the executor reconfigured: sub-layers unpinned or pinned, KV
caches moved between VRAM and host memory, nothing lost. A budget that shrinks must free VRAM at
once, so it gets the planner's quick plan (no per-sub-layer search, ~10x faster to make); a
background thread makes the full plan meanwhile, and it replaces the quick one at the first step
boundary after it is ready, if the budget has held (generation never waits for the search). A
budget that grows needs nothing freed: the placement in force goes on under it while the
background thread plans, and the full plan comes into force the same way. A step that runs out
of VRAM anyway lowers the budget to what is held plus what is free and is retried.

The same background path fits the machine profile to the engine's own steps. The executor times
each step's CPU work; when a tier's runs more than CPU_OFF_BY off the estimator's time for it,
:func:`vramshard.plan.calibrate.fit_cpu_rows` fits a factor on CPU compute at that tier's rows,
and one on split FFNs' CPU parts on top where the tier has them (each tier once per engine, and again
after a lasting change in the cores busy beside the engine: a game that starts or stops; see
:mod:`~vramshard.runtime.host_load`).
Where the CPU work is not timed, when the plan in force decodes more than CALIBRATE_OFF_BY off
its prediction, :func:`vramshard.plan.calibrate.fit` finds the factor on
split FFNs' CPU parts (or on all CPU compute) that explains the whole step. Either way the plan
made with the fitted profile comes into force at a step boundary (``why``: "calibrate"; at most
MAX_CALIBRATIONS times; ``VRAMSHARD_CALIBRATE=off`` turns it off): its quick plan first where that is
predicted QUICK_GAIN faster than the plan in force over the engine's recent steps, then the full one as a
"refine" (QUICK_REPLAN).

A fit can be wrong (on a host whose CPU speed swings, it may explain a slow spell), and the plan
it leads to slower than the one it replaced: in the seventeenth GPU session llama3-8b at 8 GiB
went from 91 ms decode steps to 122 ms after two dispatch fits. So the measured decode step of
each plan under a budget is kept (from REVERT_MIN_STEPS steps on), and a plan whose own steps run
more than REVERT_OFF_BY slower than the fastest plan measured under that budget gives way to it
(``why``: "revert"), with the profile it ran under when first measured (a plan that runs the
measured tier's steps alike, differing only in other tiers, takes the record instead); no whole-step fit is made
under that budget after that (a vision-language model, whose placements carry its vision phase's
too, is not reverted). A fit of a tier's CPU work acts after a few steps, before REVERT_MIN_STEPS, so
the plan it replaces is kept with the steps it ran (RECORD_MIN_STEPS or more, counted until the
new plan comes in): in the thirty-third GPU session such a fit took llama3-8b at 8 GiB from 70-76 ms
decode steps to 103-141 ms, and with nothing kept to go back to the slower plan stayed.

Every adaptation is recorded with its times: waiting for the step boundary, planning, releasing.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Callable

import torch

from .env import switch
from .errors import BudgetError
from .plan import calibrate
from .plan.placement import TieredPlacement
from .plan.planner import machine_profile
from .plan.tiers import Tiers
from .runtime import budget as budgets
from .runtime import host_load, plan_process
from .runtime.executor import ReconfigureReport, default_threads
from .runtime.plan_check import MIN_STEPS
from .units import format_bytes

log = logging.getLogger(__name__)

EVENTS_KEPT = 256
CALIBRATE = switch("VRAMSHARD_CALIBRATE", default=True)
CALIBRATE_OFF_BY = 1.15  # measured / predicted decode step beyond which the profile is fitted again
MAX_CALIBRATIONS = 6  # per engine (a tier's CPU work is fitted once): a machine whose speed swings more is not chased
# While the planning process makes a plan, the steps compute on one thread fewer (a core for it:
# runtime/plan_process.py); off (VRAMSHARD_SPARE_PLANNING_CORE=off), it waits for idle cores.
SPARE_PLANNING_CORE = switch("VRAMSHARD_SPARE_PLANNING_CORE", default=True)
REVERT_OFF_BY = 1.10  # a plan's decode step this much slower than the fastest measured under its budget gives way
REVERT_MIN_STEPS = 16  # decode steps of a plan before its median is compared (a slower plan should not run long)
RECORD_MIN_STEPS = 8  # decode steps of a plan a calibration replaces before they are kept as its measure
# A fit's (or a load change's) plan: the quick one first, in force at the first step boundary after it is made, then
# the full one. Beside the steps the planning process gets one core at the idle class, and a full plan of
# llama3-8b at 4 GiB came 6.9 s after its fit or not within the benchmark cell (docs/BENCHMARKS.md,
# forty-first GPU session); the quick plan is about 10x less work, and its one-token tier was within
# 0-1.2% of the full plan's prediction for llama3-8b, nemo-8b and qwen3-30b-a3b at 2-8 GiB
# (benchmarks.planning_time, session 46). Off (VRAMSHARD_QUICK_REPLAN=off): the full plan only.
QUICK_REPLAN = switch("VRAMSHARD_QUICK_REPLAN", default=True)
# A fit's quick plan comes into force only where the fitted profile predicts the engine's recent steps (STEP_MIX_KEPT,
# by tier) at least this much faster under it than under the plan in force (which still fits the budget); else the
# plan in force goes on until the full plan.
# In the forty-fourth GPU session every fit's quick plan of llama3-8b came in and its full plan 1.4-2.3 s later: two
# switches where one would do, the quick one at 8 GiB unpinning 30 sub-layers that the full one pinned again
# (147-163 ms each, its steps eager meanwhile: the graph memory limit reached; docs/BENCHMARKS.md).
QUICK_GAIN = 1.10
STEP_MIX_KEPT = 512  # the engine's most recent steps whose tiers weigh a quick plan against the plan in force
# The fit of the host's GPU dispatch from the rest of a slow step whose CPU work was timed (calibrate.fit_dispatch).
# Off (VRAMSHARD_DISPATCH_FIT=off): such a step is fitted no further. The gap it explains may be the host's memory
# or PCIe rather than its launches: in the forty-second GPU session a dispatch fit of 2.86x re-planned llama3-8b at
# 2 GiB toward the CPU, the KV cache to host memory, and it decoded behind layers:2 (docs/BENCHMARKS.md); in the
# seventeenth two fits made llama3-8b at 8 GiB slower. The switch is there for the A/B that settles it.
DISPATCH_FIT = switch("VRAMSHARD_DISPATCH_FIT", default=True)


@dataclasses.dataclass
class MeasuredPlan:
    """A plan whose single-sequence decode steps were measured under one budget."""

    plan: object  # the PlanSet
    name: str  # its placements' name, as the executor gives it
    median_s: float  # median forward seconds of its decode steps
    profile: object  # the machine profile it was made with


def _ms(seconds: dict[int, float]) -> dict[int, float]:
    return {tier: round(value * 1e3, 1) for tier, value in sorted(seconds.items())}


class BudgetFollower:
    """The budget side of an :class:`~vramshard.engine.Engine`: its source, the plans made for
    budgets seen so far, and the record of adaptations (``events``, newest last)."""

    def __init__(self, engine, vram_budget: int | None):
        self.engine = engine
        self.watcher = budgets.BudgetWatcher(budgets.SettableBudget(vram_budget), vram_budget)
        self.settings: budgets.PlanSettings | None = None  # default: made on the first re-plan
        self.plan_cache = budgets.PlanCache()
        self.events: collections.deque[dict] = collections.deque(maxlen=EVENTS_KEPT)
        # After a quick plan for a budget that shrank: (that budget, the KV side it forced), whose
        # full plan the background thread makes and the next step boundary after it puts in force.
        self.refine: tuple[int | None, bool | None] | None = None
        self.refine_why = "refine"  # or "calibrate": the event the refined plan is recorded as
        self.refine_quick = False  # a quick plan for ``refine`` is being made first (QUICK_REPLAN): put it in force
        self.calibrations: list[dict] = []  # fits of the profile to measured steps, oldest first
        self.cpu_judged: set[int] = set()  # tiers whose CPU work was judged (fitted or found in tolerance)
        self.fastest: dict[int | None, MeasuredPlan] = {}  # by budget key: the fastest decode plan measured
        self.reverted: set[int | None] = set()  # budget keys where a re-planned plan gave way: no more whole-step fits
        # The cores busy beside the engine (a game, other work): a lasting change judges the CPU work again.
        self.load_shift = host_load.LoadShift(host_load.OtherLoad(children=plan_process.child_pids)) \
            if host_load.available() else None
        self.load_changes: list[dict] = []  # those changes, oldest first
        self.calibration_floor = 0  # calibrations before the last load change (MAX_CALIBRATIONS counts from it)
        self.learning = True  # fits go to the calibration store for later processes (not a moment's load's)
        self.asked_threads: int | None = None  # the engine's own thread limit (--threads), taken at the first change
        self.load_threads: int | None = None  # the thread limit the load beside the engine set (None: none)
        self.background = BackgroundPlanner(self._plan_fully)
        self.recent_tiers: collections.deque[int] = collections.deque(maxlen=STEP_MIX_KEPT)  # (the engine's steps)

    # ------------------------------------------------------------------ the source
    def set_vram(self, vram: str | int | None) -> None:
        """See :meth:`Engine.set_vram`."""
        value = budgets.parse_vram(vram)
        watcher = self.watcher
        if value == budgets.AUTO:
            if self.engine.device == "cpu" or not torch.cuda.is_available():
                raise BudgetError("vram 'auto' follows the free VRAM of a GPU, and this engine runs without one; "
                                  "give a size such as 4GiB")
            watcher.set_source(budgets.AutoBudget(self.engine.device))
        elif isinstance(watcher.source, budgets.SettableBudget):
            watcher.source.set(value)
        else:
            watcher.set_source(budgets.SettableBudget(value))
        log.info("VRAM budget set to %s; effective at the next step", vram)

    def poll(self):
        """Adapt if the budget changed, or refine a quick plan whose budget held (a step boundary).
        Returns the executor's :class:`~vramshard.runtime.executor.ReconfigureReport`, or None."""
        executor = self.engine.executor
        with executor.lock:  # one adaptation at a time, never during a step
            if SPARE_PLANNING_CORE:
                executor.spare_a_core(plan_process.planning())  # (the planning process's core: see there)
            change = self.watcher.poll(executor.need.total if executor.uses_gpu else None)
            if change is not None:
                return self.adapt(change.budget, change.requested_at, change.source)
            if self.refine is not None and self._full_plan_ready(*self.refine):
                budget, _ = self.refine
                self.refine = None
                if budget == self.watcher.in_force:
                    return self.adapt(budget, time.monotonic(), self.refine_why)
            if self.refine is not None and self.refine_quick and self._quick_plan_ready(*self.refine):
                self.refine_quick = False
                budget, _ = self.refine
                if budget == self.watcher.in_force and self._quick_plan_gains(*self.refine):
                    return self.adapt(budget, time.monotonic(), self.refine_why, quick=True)  # (the full one follows)
            self._follow_host_load()  # (also while a plan is awaited: a new load asks for another)
            if self.refine is None:
                self._calibrate_if_off()
            return None

    def decode_steps_to_judge(self) -> int:
        """One-sequence decode steps the plan in force has still to run before the engine judges them
        against its prediction (:meth:`_calibrate_if_off`: a fit, and the plans it asks for, may follow
        then); 0 where no such judgment is to come (a benchmark's warm-up runs them: cli/bench.py)."""
        engine = self.engine
        if not CALIBRATE or engine.plan is None or engine.device == "cpu" \
                or len(self.calibrations) - self.calibration_floor >= MAX_CALIBRATIONS \
                or budgets.budget_key(self.watcher.in_force) in self.reverted:
            return 0
        check = engine.plan_check()
        if check.predicted_s is None or check.calibrated:
            return 0
        return max(0, MIN_STEPS - len(check.measured))

    def _calibrate_if_off(self) -> None:
        """When the plan in force's single-sequence decode steps run more than REVERT_OFF_BY slower
        than a plan measured before under its budget, go back to that plan; else, when they run more
        than CALIBRATE_OFF_BY off its prediction, fit the profile to them and plan again in the
        background (caller holds the executor lock)."""
        engine = self.engine
        if not CALIBRATE or engine.plan is None or engine.device == "cpu":
            return
        check = engine.plan_check()
        if check.plan is engine.plan and len(check.measured) >= REVERT_MIN_STEPS and self._revert_if_slower(check):
            return
        if len(self.calibrations) - self.calibration_floor >= MAX_CALIBRATIONS or self._calibrate_cpu_work():
            return
        if check.plan is not engine.plan or check.calibrated or len(check.measured) < MIN_STEPS \
                or budgets.budget_key(self.watcher.in_force) in self.reverted:
            return
        cpu = engine.cpu_check()
        timed = check.tier in cpu.judged or bool(cpu.samples.get(check.tier))  # the CPU work is timed
        if timed and check.tier not in cpu.judged:
            return  # its CPU work is judged first (above)
        ratio = check.ratio()
        if ratio is None or 1 / CALIBRATE_OFF_BY <= ratio <= CALIBRATE_OFF_BY:
            return
        check.calibrated = True  # one fit per plan: the plan it leads to is checked afresh
        if timed and not DISPATCH_FIT:
            log.info("decode steps of %s take %.1f ms where %.1f ms was predicted, its CPU work as fitted: the "
                     "dispatch is not fitted (VRAMSHARD_DISPATCH_FIT=off)", check.plan_name,
                     check.median_s() * 1e3, check.predicted_s * 1e3)
            return
        settings = self.plan_settings()
        # With the CPU work fitted from its own timing, the rest of the gap is the host's dispatch of
        # the GPU work (the tenth GPU session: 27-57 ms a step, about twice the estimator's charge).
        fit = calibrate.fit_dispatch if timed else calibrate.fit
        with settings.pricing():  # (the engine's own link and graphs, as its plans were priced)
            fitted = fit(engine.model, settings.profile, engine.plan, check.median_s(), check.tier)
        if fitted is None:
            return
        if timed and self.learning:
            calibrate.learn(fitted.profile, engine.model.dtype)
        self.calibrations.append({"time": time.time(), "plan": check.plan_name, "predicted_s": check.predicted_s,
                                  "measured_s": check.median_s(), fitted.what: fitted.value})
        log.info("decode steps of %s take %.1f ms where %.1f ms was predicted: fitted the profile's %s to %.4g "
                 "from them; planning again with it in the background", check.plan_name, check.median_s() * 1e3,
                 check.predicted_s * 1e3, fitted.what, fitted.value)
        self._plan_with(fitted.profile)

    def _follow_host_load(self) -> None:
        """When the cores busy beside the engine have moved for good (a game started or stopped beside it:
        :class:`~vramshard.runtime.host_load.LoadShift`) since its CPU work was judged (or, with nothing to
        judge, since it started): compute on the cores left (:func:`~vramshard.runtime.host_load.threads_beside`,
        within the engine's own ``--threads``), plan again at that many threads in the background, and judge
        the CPU work again (:meth:`_judge_again`). Caller holds the executor lock."""
        shift, engine = self.load_shift, self.engine
        if shift is None:
            return
        judges = CALIBRATE and engine.plan is not None and engine.device != "cpu"
        if not shift.settled and not judges:
            shift.settle()  # (nothing to judge: the load at the start is the reference)
        if not shift.settled:
            return  # (the reference is the load the CPU work is first judged under)
        before = shift.reference
        if not shift.poll(engine.executor.step_threads):
            return
        if not self.load_changes:
            self.asked_threads = engine.executor.threads
        self.load_threads = host_load.threads_beside(shift.reference, shift.cores, default_threads())
        limits = [t for t in (self.load_threads, self.asked_threads) if t is not None]
        limit = min(limits) if limits else None
        change = {"time": time.time(), "other_cores_before": round(before, 2),
                  "other_cores_now": round(shift.reference, 2), "threads": limit, "tiers": sorted(self.cpu_judged)}
        self.load_changes.append(change)
        log.info("the cores busy beside the engine went from %.1f to %.1f: computing on %s CPU threads%s",
                 before, shift.reference, limit or "all", ", judging its CPU work again" if self.cpu_judged else "")
        if judges and self.cpu_judged:
            self._judge_again()
        if limit == engine.executor.threads:
            return
        engine.executor.limit_threads(limit)
        if engine.plan is None:
            return  # (a named placement: nothing to plan)
        self._plan_with(self.plan_settings().profile.limited_to(limit), "host load")

    def _judge_again(self) -> None:
        """Judge the CPU work again after a change of the load beside the engine: each tier's is timed
        afresh and fitted where it runs off the profile as fitted so far (the factors compose), the plans
        measured under the old load stop being the ones to beat, MAX_CALIBRATIONS counts afresh, and no fit
        made from now on goes to the calibration store (it is this moment's load, not the machine's)."""
        self.cpu_judged.clear()  # (the engine's checks share the set)
        self.engine.restart_cpu_check()
        self.fastest.clear()
        self.reverted.clear()
        self.calibration_floor = len(self.calibrations)
        self.learning = False

    def _revert_if_slower(self, check) -> bool:
        """Keep the fastest measured decode plan under the budget in force; when the plan in force
        (``check``: its measured decode steps) runs more than REVERT_OFF_BY slower than it, put that
        plan back in force with its profile, which later engines of the process (and the calibration file)
        start from too. Tiers whose own CPU work was fitted since that plan was measured keep the fit
        (:meth:`_kept_fits`). Returns whether it did (caller holds the executor lock)."""
        engine, budget = self.engine, self.watcher.in_force
        if self._vision_tiered():
            return False  # its placements carry the vision phase's, which the language model's plan does not
        median = check.median_s()
        best = self._keep_measured(check)
        if best is None or median <= REVERT_OFF_BY * best.median_s:
            return False
        settings = self.plan_settings()
        kv_forced = budgets.forced_kv_side(engine.executor.live_kv_positions(), settings)
        if kv_forced is False and best.plan.kv_on_gpu:
            return False  # the live caches no longer fit that plan's KV reservation
        plan, profile, kept = self._kept_fits(best, check.tier)
        started = time.monotonic()
        try:
            report = engine.executor.reconfigure(plan.tiered(), budget)
        except BudgetError as exc:
            log.warning("could not go back to plan %s (%s)", best.name, exc)
            return False
        adaptation = budgets.adaptation_between(engine.model, engine.plan, plan, budget)
        log.info("decode steps of %s take %.1f ms, %.2fx the %.1f ms of %s measured before under this budget: "
                 "going back to it and its profile%s; no more whole-step fits under this budget", check.plan_name,
                 median * 1e3, median / best.median_s, best.median_s * 1e3, best.name,
                 f" (tiers {sorted(kept)} as re-planned from their own CPU work's fit since)" if kept else "")
        self.calibrations.append({"time": time.time(), "plan": check.plan_name, "measured_s": median,
                                  "reverted_to": best.name, "reverted_to_measured_s": best.median_s,
                                  "tiers_kept": sorted(kept)})
        engine.plan = plan
        self.settings = dataclasses.replace(settings, profile=profile)
        if self.learning:
            calibrate.learn(profile, engine.model.dtype)  # (later engines start from it, not from the fit given up)
        self.plan_cache = budgets.PlanCache()  # plans of the profile given up
        self.refine, self.refine_why = None, "refine"
        self.reverted.add(budgets.budget_key(budget))
        self._record(adaptation, report, "revert", started, started)
        return True

    def _kept_fits(self, best: MeasuredPlan, tier: int) -> tuple[object, object, set[int]]:
        """What a revert to ``best`` (its decode steps at ``tier`` measured faster) puts in force: its
        plan and profile, but where other tiers' CPU work was timed and fitted since (a batch's tier
        judged after a dispatch fit), those fits stay in the profile, and the plan in force's
        placements for those tiers stay where both plans lay out VRAM alike (on the H100 machine a
        revert at tier 1 threw away tier 64's fit, 1.83x, and ran 64 sequences on the placement priced
        without it; docs/BENCHMARKS.md, forty-sixth GPU session). Returns (plan, profile, the tiers
        whose placements stayed)."""
        now = self.plan_settings().profile
        fitted = calibrate.tiers_fitted_since(now, best.profile, set(best.plan.tiers) - {tier})
        if not fitted:
            return best.plan, best.profile, set()
        profile = calibrate.with_row_factors_of(best.profile, now, fitted)
        current = self.engine.plan
        if current is None or not best.plan.holds_vram_as(current):
            return best.plan, profile, set()
        kept = {t for t in fitted if not same_tier_steps(best.plan, current, t)}
        return (best.plan.with_tiers_of(current, kept) if kept else best.plan), profile, kept

    def _vision_tiered(self) -> bool:
        """Whether the engine's placements carry a vision phase's (a vision-language model's vision tier)."""
        vision = self.engine.vision
        return vision is not None and bool(vision.vision_tier)

    def _keep_measured(self, check, new_record: bool = True) -> MeasuredPlan | None:
        """Keep ``check``'s plan (the plan in force) as the fastest measured under the budget in force
        where it is the first measured there, runs faster than the record, or runs the measured tier's
        steps as the record's plan does (``new_record`` False: only refresh the record's median where it
        is this plan). Returns the record it runs slower than, else None."""
        key = budgets.budget_key(self.watcher.in_force)
        median = check.median_s()
        best = self.fastest.get(key)
        if best is not None and best.plan is check.plan:
            best.median_s = median  # its latest steps; the profile stays the one it ran under first
            return None
        # A plan that runs the measured tier's steps as the best did is no slower for its own doing: it
        # takes the record. (nemo-8b's one-token steps at 2 GiB measured 137 ms in early warm-up runs, then
        # 159 ms under a re-plan that changed only its 512-token tier, and the engine went back to the
        # first plan, whose steps at 1K context then took about as long; docs/BENCHMARKS.md, thirty-first
        # GPU session.)
        if best is None or median < best.median_s or same_tier_steps(best.plan, check.plan, check.tier):
            if new_record:
                self.fastest[key] = MeasuredPlan(check.plan, check.plan_name, median, self.plan_settings().profile)
            return None
        return best

    def _keep_outgoing(self, new_record: bool) -> None:
        """Keep the plan in force's decode steps so far (RECORD_MIN_STEPS or more) as its measure, before a
        calibration's plan replaces it: at the fit (``new_record``, with the profile it ran under) and
        again when the new plan comes in (its median refreshed by the steps it ran meanwhile)."""
        engine = self.engine
        check = engine.plan_check()
        if check.plan is engine.plan and engine.plan is not None and len(check.measured) >= RECORD_MIN_STEPS \
                and not self._vision_tiered():
            self._keep_measured(check, new_record)

    def _calibrate_cpu_work(self) -> bool:
        """When a tier's CPU work (as the executor timed it) runs more than CPU_OFF_BY off the
        estimator's time for it, fit the profile's CPU factor at that tier's rows and plan again in
        the background. Each tier is judged once per engine, from steps that ran while no background
        plan was being made (its Python holds the GIL and slows the step's host work: on the H200
        machine the measured CPU work grew 1.4-3x then). Returns whether it did (caller holds the
        executor lock)."""
        engine = self.engine
        check = engine.cpu_check()
        ready = check.ready()
        if check.plan is not engine.plan or not ready:
            return False
        self.cpu_judged.update(ready)  # once per tier and load: a fit that chased its own re-plans would drift
        if self.load_shift is not None:
            self.load_shift.settle()  # (judged under the load beside the engine now)
        settings = self.plan_settings()
        split = check.split_of(ready)
        with settings.pricing():
            fitted = calibrate.fit_cpu_rows(engine.model, settings.profile, engine.plan, ready, split)
        if fitted is None:
            return False
        if self.learning:
            calibrate.learn(fitted.profile, engine.model.dtype)
        with settings.pricing():
            predicted = {tier: calibrate.cpu_seconds(engine.model, settings.profile, engine.plan, tier)
                         for tier in ready}
        split_rows = dict(fitted.profile.split_rows)
        self.calibrations.append({"time": time.time(), "plan": engine.executor.plans.name,
                                  "cpu_measured_s": ready, "cpu_split_measured_s": split,
                                  "cpu_predicted_s": predicted, "cpu_rows": fitted.value, "split_rows": split_rows})
        log.info("the CPU work of plan %s took %s (%s of it in split FFN parts) where %s was predicted (ms per "
                 "step, by tier): fitted the profile's CPU factors by rows to %s, and the split parts' to %s on "
                 "top; planning again with them in the background", engine.executor.plans.name, _ms(ready),
                 _ms(split), _ms(predicted), {rows: round(f, 3) for rows, f in fitted.value.items()},
                 {rows: round(f, 3) for rows, f in split_rows.items()})
        self._plan_with(fitted.profile)
        return True

    def _plan_with(self, profile, why: str = "calibrate") -> None:
        """Plan the budget in force again with ``profile`` in the background: a calibration's fit, or
        the profile limited to the threads the load beside the engine leaves (``why`` "host load"). The
        plan is put in force, as ``why``, at the first step boundary after it is made (:meth:`poll`)."""
        if why == "calibrate":
            self._keep_outgoing(new_record=True)  # (before the fitted profile becomes the settings')
        self.settings = dataclasses.replace(self.plan_settings(), profile=profile)
        self.plan_cache = budgets.PlanCache()  # plans of the old profile (or thread count)
        budget = self.watcher.in_force
        kv_forced = budgets.forced_kv_side(self.engine.executor.live_kv_positions(), self.settings)
        quick = QUICK_REPLAN and not self._vision_tiered()  # (a vision-language model re-plans with its vision phase)
        self.refine, self.refine_why, self.refine_quick = (budget, kv_forced), why, quick
        self.background.want(budget, kv_forced, quick)

    def _full_plan_ready(self, budget: int | None, kv_forced: bool | None) -> bool:
        return self.plan_cache.peek((budgets.budget_key(budget), kv_forced, True)) is not None

    def _quick_plan_ready(self, budget: int | None, kv_forced: bool | None) -> bool:
        return self.plan_cache.peek((budgets.budget_key(budget), kv_forced, False)) is not None

    def _quick_plan_gains(self, budget: int | None, kv_forced: bool | None) -> bool:
        """Whether a fit's (or a load change's) quick plan is worth a switch of its own before its full plan:
        the profile it was made with predicts the engine's recent steps (their tiers, one-token steps where
        none ran yet) at least QUICK_GAIN faster under it than under the plan in force (each switch stops
        the steps, and the new plan's first steps pay its first calls)."""
        engine = self.engine
        quick = self.plan_cache.peek((budgets.budget_key(budget), kv_forced, False))
        if engine.plan is None or quick is None:
            return True
        mix = {tier: n for tier, n in collections.Counter(self.recent_tiers or [1]).items()
               if tier in engine.plan.tiers and tier in quick.tiers}
        if not mix:
            return True
        profile = self.plan_settings().profile

        def seconds(plan) -> float:
            return sum(n * calibrate.step_seconds(engine.model, profile, plan, tier) for tier, n in mix.items())

        in_force_s, quick_s = seconds(engine.plan), seconds(quick)
        if in_force_s >= QUICK_GAIN * quick_s:
            return True
        log.info("the quick plan after the %s is predicted to run the engine's last %d steps (by tier %s) in %.1f "
                 "ms against %.1f ms for the plan in force: the plan in force goes on until the full plan",
                 self.refine_why, sum(mix.values()), dict(sorted(mix.items())), quick_s * 1e3, in_force_s * 1e3)
        self.events.append({"time": time.time(), "why": self.refine_why, "budget": budget,
                            "plan": engine.executor.plans.name, "quick_plan_skipped": True,
                            "quick_predicted_s": quick_s, "in_force_predicted_s": in_force_s})
        return False

    def _plan_fully(self, budget: int | None, kv_forced: bool | None, quick_first: bool = False) -> None:
        """The full plan for ``budget`` into the plan cache, after the quick one where ``quick_first``
        (on the background thread; made in the planning process, :mod:`~vramshard.runtime.plan_process`,
        so the steps beside it keep the GIL)."""
        model, settings, executor = self.engine.model, self.plan_settings(), self.engine.executor

        def make(*args, **kwargs):
            plan = plan_process.make_plan_off_thread(*args, **kwargs)
            plans = plan.tiered()
            try:  # its CPU parts packed before the plan can come into force (the switch stops the steps)
                executor.prepare(plans)
            except Exception:  # (the switch packs them, as before)
                log.exception("could not pack the CPU parts of plan %s ahead: the switch will", plans.name)
            return plan

        if quick_first:
            budgets.plan_for_budget(model, settings, budget, kv_forced, self.plan_cache, search=False, make=make)
        budgets.plan_for_budget(model, settings, budget, kv_forced, self.plan_cache, make=make)

    def state(self) -> dict:
        """The budget in force and the VRAM in use, for ``GET /v1/budget`` and logs."""
        engine, executor = self.engine, self.engine.executor
        real_gpu = executor.gpu is not None and not executor.simulated
        return {
            "vram_budget": self.watcher.in_force,
            "source": self.watcher.source.name,
            "device": engine.device,
            "simulated_gpu": executor.simulated,
            "vram_planned": executor.need.total,
            "vram_planned_breakdown": executor.need.breakdown(),
            "vram_reserved": torch.cuda.memory_reserved(executor.gpu) if real_gpu else 0,
            "vram_peak": executor.peak_vram(),
            "kv_on_gpu": bool(executor.kv_layers_on_gpu),
            "plan": executor.plans.name,
            "last_change": self.events[-1] if self.events else None,
            "calibrations": list(self.calibrations),
        }

    def plan_settings(self) -> budgets.PlanSettings:
        """What the planner needs besides the budget (made from the engine on first use)."""
        if self.settings is None:
            engine = self.engine
            plan = engine.plan
            tiers = Tiers(tuple(sorted(plan.tiers))) if plan is not None else \
                Tiers(tuple(t for t in Tiers().sizes if t <= engine.max_step_tokens) or (engine.max_step_tokens,))
            slots = plan.num_slots if plan is not None and plan.num_slots else engine.executor.num_slots
            self.settings = budgets.PlanSettings(machine_profile(), tiers, engine.kv_tokens, slots, engine.model_name,
                                                 decode_graphs=engine.executor.decode_graphs)
        return self.settings

    # ------------------------------------------------------------------ adapting
    def adapt(self, budget: int | None, requested_at: float, why: str, quick: bool = False):
        """Re-plan under ``budget`` and reconfigure the executor (caller holds the executor lock).
        ``quick``: with the quick plan (cached by the background thread; the full one follows)."""
        engine, executor = self.engine, self.engine.executor
        if engine.device == "cpu":  # no GPU: nothing to give back
            engine.vram_budget = budget
            self.watcher.accept(budget)
            return None
        settings = self.plan_settings()
        planning_from = time.monotonic()
        if self._defer_growth(budget, why, settings, requested_at):
            return None
        if self._vision_tiered():
            adaptation, placements = self._adapt_vision(budget)
        else:
            shrinks = budget is not None and (engine.vram_budget is None or budget < engine.vram_budget)
            adaptation = budgets.adapt_plan(engine.model, settings, engine.plan, budget, executor.live_kv_positions(),
                                            self.plan_cache, search=not (shrinks or quick))
            placements = adaptation.plan.tiered()
        self.refine, self.refine_why, self.refine_quick = None, "refine", False
        if adaptation.quick:
            kv_forced = budgets.forced_kv_side(executor.live_kv_positions(), settings)
            self.refine = (budget, kv_forced)
            self.background.want(budget, kv_forced)
        if why in ("refine", "calibrate", "host load") and engine.plan is not None \
                and same_placements(adaptation.plan, engine.plan):
            engine.plan = adaptation.plan  # the same placements (new predictions): nothing to move
            if why in ("calibrate", "host load"):
                self.events.append({"time": time.time(), "why": why, "budget": budget, "plan": executor.plans.name,
                                    "placements_kept": True})
            return None
        if why == "calibrate":
            self._keep_outgoing(new_record=False)
        try:
            report = executor.reconfigure(placements, budget)
        except BudgetError as exc:  # the executor counts VRAM its own way: fall back to the CPU
            log.warning("the plan for %s does not fit as the executor counts it (%s); running on the CPU",
                        "no limit" if budget is None else format_bytes(budget), exc)
            plan = budgets.cpu_plan_set(engine.model, settings, budget, f"fallback: {exc}")
            adaptation = budgets.adaptation_between(engine.model, engine.plan, plan, budget)
            report = executor.reconfigure(plan.tiered(), budget)
        engine.plan = adaptation.plan
        engine.vram_budget = budget
        self.watcher.accept(budget)
        self._record(adaptation, report, why, requested_at, planning_from)
        return report

    def _defer_growth(self, budget: int | None, why: str, settings: budgets.PlanSettings,
                      requested_at: float) -> bool:
        """A budget that grew frees nothing: the placement in force still fits it, so steps go on
        under it while the background thread makes the full plan, which the first step boundary
        after it is ready puts in force (as for a quick plan). Planning under the executor's lock
        stalled generation for the whole search (0.6-1.3 s for llama3-8b on the H200 machine).
        Returns whether the change was deferred (the budget is then in force)."""
        engine = self.engine
        grew = budget is None or (engine.vram_budget is not None and budget > engine.vram_budget)
        if not grew or engine.plan is None or why in ("refine", "out of memory") \
                or self._vision_tiered():
            return False
        kv_forced = budgets.forced_kv_side(engine.executor.live_kv_positions(), settings)
        if self._full_plan_ready(budget, kv_forced):
            return False  # planned before: put it in force now
        engine.vram_budget = budget
        self.watcher.accept(budget)
        self.refine, self.refine_quick = (budget, kv_forced), False  # (the placement in force goes on meanwhile)
        self.background.want(budget, kv_forced)
        executor = engine.executor
        reserved = executor.reserved_bytes()
        unchanged = ReconfigureReport(0.0, 0.0, 0, 0, reserved, reserved, executor.need,
                                      {"wait": 0.0, "kv": 0.0, "drop": 0.0, "empty": 0.0})
        stay = budgets.adaptation_between(engine.model, engine.plan, engine.plan, budget)
        self._record(stay, unchanged, why, requested_at, time.monotonic(), deferred=True)
        return True

    def _adapt_vision(self, budget: int | None) -> tuple[budgets.Adaptation, TieredPlacement]:
        """A vision-language model: the language model planned with room for the vision phase beside
        it, as :func:`vramshard.vlm.configure` does at load; its placements end with the vision tier."""
        from . import vlm

        engine, settings = self.engine, self.plan_settings()
        kv_forced = budgets.forced_kv_side(engine.executor.live_kv_positions(), settings)
        try:
            placements, plan = vlm.plans_for_budget(engine, budget, kv_forced, settings.profile)
        except BudgetError as exc:
            plan = budgets.cpu_plan_set(engine.model, settings, budget, f"{exc}; all on the CPU")
            placements = plan.tiered()
        return budgets.adaptation_between(engine.model, engine.plan, plan, budget), placements

    def _record(self, adaptation: budgets.Adaptation, report, why: str, requested_at: float,
                planning_from: float, deferred: bool = False) -> None:
        """One adaptation into ``events``, and the log. ``deferred``: a budget that grew, kept under
        the placement in force while the background thread plans it (its "refine" follows)."""
        executor = self.engine.executor
        waited = max(0.0, planning_from - requested_at)  # the change seen, the step under way finishing
        # Re-planning (or a cached plan); nothing planned under the lock for a deferred growth.
        planned = 0.0 if deferred else max(0.0, time.monotonic() - planning_from - report.total_s)
        budget = adaptation.budget
        event = {
            "time": time.time(), "why": why, "budget": budget, "plan": executor.plans.name,
            "vram_planned": executor.need.total, "kv_on_gpu": bool(executor.kv_layers_on_gpu),
            "unpinned": len(adaptation.unpin), "pinned": len(adaptation.pin),
            "kv_bytes_to_host": report.kv_bytes_to_host, "kv_bytes_to_gpu": report.kv_bytes_to_gpu,
            "quick_plan": adaptation.quick,
            "wait_s": waited, "plan_s": planned, "release_s": report.release_s, "adapt_s": report.total_s,
            "release_parts_s": dict(report.release_parts),
            "time_to_release_s": waited + planned + report.release_s,
            "reserved_after_release": report.reserved_after_release, "reserved_after": report.reserved_after,
        }
        if deferred:
            event["deferred"] = True
            self.events.append(event)
            log.info("VRAM budget (%s) grew to %s: planning it in the background; the placement in force (%s) "
                     "goes on meanwhile", why, "no limit" if budget is None else format_bytes(budget),
                     format_bytes(executor.need.total))
            return
        self.events.append(event)
        log.info("VRAM budget (%s) -> %s: %s; VRAM released %.1f ms after the change (%.1f ms waiting for the "
                 "step boundary, %.1f ms planning), adapted in %.1f ms", why,
                 "no limit" if budget is None else format_bytes(budget), adaptation.summary(),
                 event["time_to_release_s"] * 1e3, waited * 1e3, planned * 1e3, report.total_s * 1e3)

    def recover_from_oom(self, failure: str) -> None:
        """The executor ran out of VRAM in a step: re-plan under what this process holds plus what
        is free now, less a margin, before the step is retried."""
        executor = self.engine.executor
        need = executor.need.total
        if executor.gpu is not None and not executor.simulated:
            held = torch.cuda.memory_reserved(executor.gpu)
            free, _ = budgets.free_vram(executor.gpu)
        else:
            held, free = need, 0
        target = budgets.budget_after_oom(need, held, free)
        log.warning("out of VRAM during a step (%s): re-planning under %s (the plan needed %s) and retrying the step",
                    failure, format_bytes(target), format_bytes(need))
        self.watcher.lower(target)
        self.adapt(target, time.monotonic(), "out of memory")


class BackgroundPlanner:
    """A daemon thread that calls ``make(budget, kv_forced)`` for the latest budget asked for: a
    budget falling in steps is planned once it settles, not once per step."""

    def __init__(self, make: Callable[[int | None, bool | None], None]):
        self._make = make
        self._lock = threading.Lock()
        self._wanted: tuple | None = None
        self._thread: threading.Thread | None = None
        self.finished_at = 0.0  # time.time() when the thread last ran out of work

    def want(self, budget: int | None, kv_forced: bool | None, *more) -> None:
        """Plan ``make(budget, kv_forced, *more)`` next (in place of anything asked for before and not
        yet begun)."""
        with self._lock:
            self._wanted = (budget, kv_forced, *more)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="vramshard-plan", daemon=True)
                self._thread.start()

    @property
    def busy(self) -> bool:
        """Whether the thread is planning now."""
        return self._thread is not None

    def wait(self, timeout: float | None = None) -> None:
        """Until the thread has planned everything asked for (tests, benchmarks)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._lock:
                wanted, self._wanted = self._wanted, None
                if wanted is None:
                    self._thread = None
                    self.finished_at = time.time()
                    return
            try:
                self._make(*wanted)
            except Exception:  # the quick plan stays in force; the next budget change plans again
                log.exception("planning in the background under %s failed", wanted[0])


def same_tier_steps(a, b, tier: int) -> bool:
    """Whether two plan sets run steps of ``tier`` tokens alike: the same placement, threads, packing,
    worker team and zero-copy share at that tier, the same expert cache and KV side."""
    ta, tb = a.tiered(), b.tiered()
    i, j = ta.index_for(tier), tb.index_for(tier)
    return (ta.placements[i].where == tb.placements[j].where and ta.threads[i] == tb.threads[j]
            and ta.packs(tier) == tb.packs(tier) and ta.worker_threads_for(tier) == tb.worker_threads_for(tier)
            and ta.zero_copy_cpu_share(tier) == tb.zero_copy_cpu_share(tier) and ta.expert_cache == tb.expert_cache
            and a.kv_on_gpu == b.kv_on_gpu)


def same_placements(a, b) -> bool:
    """Whether two plan sets place every sub-layer alike in every tier (families' names aside)."""
    ta, tb = a.tiered(), b.tiered()
    return (ta.tiers == tb.tiers and ta.threads == tb.threads and ta.expert_cache == tb.expert_cache
            and ta.zero_copy_cpu_shares == tb.zero_copy_cpu_shares and ta.worker_threads == tb.worker_threads
            and ta.packed == tb.packed
            and a.kv_on_gpu == b.kv_on_gpu and [p.where for p in ta.placements] == [p.where for p in tb.placements])
