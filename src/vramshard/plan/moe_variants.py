"""The planner's variants for Mixture-of-Experts models (a mixin of :class:`~.planner.Planner`).

A MoE FFN splits at its experts: its main piece (norm, router, any shared expert) in VRAM, its
routed experts computed on the CPU (``experts-cpu``), copied into the VRAM expert cache
(``experts-stream``), or each layer one way so the CPU and PCIe finish together (``experts-mix``).
The variants tried: slots sized for whole MoE layers or not, the KV cache on either side, a few
expert-cache sizes against pinned sub-layers, and, where not every MoE layer's main piece fits,
the first layers split as far as theirs fit. Each is planned quickly (no search, the smallest and
largest tier), and the best is planned fully.
"""

from __future__ import annotations

import math

from ..env import switch
from ..errors import BudgetError
from ..units import format_bytes
from .estimator import Estimator, uniform_hit_rate
from .memory import expert_slot_bytes, split_router_bytes, workspace_bytes
from .placement import Placement
from .plan_set import PlanSet
from .tiers import Tiers

CACHE_FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)  # of the room left after the minimum, tried for the expert cache
FINALISTS = 2  # variants the quick plans rank first that are planned in full, the faster taken
# The CPU's share of the zero-copy experts is taken only when predicted this much faster than none:
# it adds host-memory traffic beside whatever else runs, and its prediction has been optimistic
# (22.9 tok/s predicted, 15.3 measured at the balanced share, twenty-third GPU session).
SHARE_TIE = 0.05
# Whether the planner may split a token's host experts between the CPU and the zero-copy kernels;
# otherwise it chooses between all of them read by the kernels and all computed by the CPU. Every
# split measured on a GPU decoded slower than the CPU computing them all, on the run-ahead worker
# too: qwen3-30b-a3b at 8 GiB decoded at 14.63 tok/s with the CPU's share 0.49 against 19.84 with
# all on the CPU (thirty-fourth GPU session), and at 20.71 with the planner's 7 of 8 (its step
# predicted 6% shorter than 8 of 8's) against 25.78 (thirty-fifth), the worker idle 17.2 ms a step against 2.7.
# VRAMSHARD_PLAN_ZERO_COPY_SHARE=on lets the planner split them (to measure).
PLANS_SHARES = switch("VRAMSHARD_PLAN_ZERO_COPY_SHARE", default=False)


class MoEVariants:
    """The MoE half of the planner; its state (``moe``, ``moe_split``, ``expert_cache`` ...) is the
    planner's own, set in :meth:`Planner.__init__`."""

    def _stream_whole_moe(self, whole: bool) -> None:
        """Whether MoE FFNs may stream whole (slots sized for them) or only split at their experts."""
        self.streamable = [s.name for s in self.model if s.kind in ("attn", "ffn") and (whole or s.name not in self.moe)]
        self.slot_bytes = max((self.sizes[n] for n in self.streamable), default=0)

    def _moe_reserved(self) -> int:
        """VRAM the variant keeps for MoE: the split layers' main pieces and the expert cache."""
        return split_router_bytes(self.model, self.moe_split) + self.expert_cache if self.moe_split else 0

    def _plan_moe(self) -> PlanSet:
        """Try whole-layer slots or not, KV on either side, and a few expert-cache sizes, on a
        quick plan (no search, the smallest and largest tier); then plan the best fully. Where not
        every MoE layer's main piece fits, the variants split only some layers (or none)."""
        workspace = workspace_bytes(self.model, self.tiers.largest, self.context, kv_slots=self.kv_slots)
        kv = self.kv_bytes()
        expert = expert_slot_bytes(self.model)
        least_cache = 2 * max(self.model[n].top_k for n in self.moe) * expert
        dense = sum(s.nbytes for s in self.model if s.name not in self.moe)  # attention, embedding, head, ...
        budget = math.inf if self.budget is None else self.budget
        full_tiers, options = self.tiers, []
        quick_tiers = Tiers(tuple(sorted({self.tiers.sizes[0], self.tiers.largest})))
        for whole in (True, False):
            self._stream_whole_moe(whole)
            minimum = workspace + self.ring_bytes() + self.moe_fixed + least_cache
            for kv_on_gpu in self._kv_choices():
                kv_here = kv if kv_on_gpu else 0
                room = budget - minimum - kv_here
                if room < 0:
                    continue
                sizes = [least_cache] if math.isinf(room) else \
                    sorted({least_cache + int(f * room) // expert * expert for f in CACHE_FRACTIONS})
                if dense < room < math.inf:  # the cache that leaves room to pin every sub-layer but the experts
                    sizes = sorted({*sizes, least_cache + int(room - dense) // expert * expert})
                for cache in sizes:
                    options.append((whole, kv_on_gpu, cache))
        options = [(len(self.moe), *option) for option in options]
        if not options:  # no room for every MoE layer's main piece (large shared experts)
            options = self._partial_split_options(workspace, kv, least_cache)
        if not options:
            self._stream_whole_moe(False)
            minimum = workspace + self.ring_bytes()
            raise BudgetError(
                f"a VRAM budget of {format_bytes(self.budget)} is below the minimum of {format_bytes(minimum)} "
                f"for this MoE model (workspace {format_bytes(workspace)}, {self.num_slots} streaming slots for "
                f"attention, MoE layers on the CPU); raise --vram to at least {format_bytes(minimum)}, lower the "
                "largest tier, or plan for the CPU only (--device cpu)")
        scored = []
        self.tiers = quick_tiers
        try:
            for split, whole, kv_on_gpu, cache in options:
                self._use(whole, cache, split)
                quick = self._plan_variant(kv_on_gpu, workspace, kv if kv_on_gpu else 0, search=False)
                scored.append((self._score(quick), split, whole, kv_on_gpu, cache))
        finally:
            self.tiers = full_tiers
        # The variants the quick plans rank first, planned over every tier: the quick plans see two tiers without
        # the search, and can rank a variant whose full plan is slower first (session 63: a KV cache on the CPU
        # ahead of one in VRAM that decoded 63 against 83 ms planned in full).
        finalists = []
        for _, split, whole, kv_on_gpu, cache in sorted(scored, key=lambda item: item[0])[:FINALISTS]:
            self._use(whole, cache, split)
            full = self._plan_variant(kv_on_gpu, workspace, kv if kv_on_gpu else 0, search=self.search)
            finalists.append((self._score(full), split, whole, kv_on_gpu, cache, full))
        _, split, whole, kv_on_gpu, cache, best = min(finalists, key=lambda item: item[0])
        self._use(whole, cache, split)
        best.notes.append(
            f"MoE: {'slots sized for whole MoE layers' if whole else 'no whole-layer streaming of MoE layers'}, "
            f"KV cache on the {'GPU' if kv_on_gpu else 'CPU'}, expert cache {format_bytes(cache)} "
            f"(assumed hit rate {self.estimator.expert_hit_rate:.0%}, uniform routing); "
            f"{len(scored)} variants tried")
        if split < len(self.moe):
            best.notes.append(
                f"MoE: the main pieces of the {len(self.moe)} MoE layers (norm, router, shared expert: "
                f"{format_bytes(self.moe_fixed)} in all) do not fit beside the workspace and slots: "
                + (f"{split} split at their experts, the others" if split else "none splits at its experts: they")
                + " stream whole or run on the CPU")
        top_k = min(self.model[n].top_k for n in self.moe)
        for tier, tier_plan in sorted(best.tiers.items()):
            if tier_plan.zero_copy_cpu_share:
                best.notes.append(
                    f"tier {tier}: the CPU computes {round(tier_plan.zero_copy_cpu_share * top_k)} of each token's "
                    f"{top_k} host experts on the run-ahead worker while the GPU's kernels read the others "
                    "from pinned memory")
        return best

    def _partial_split_options(self, workspace: int, kv: int, least_cache: int) -> list[tuple[int, bool, bool, int]]:
        """``(split, whole, kv_on_gpu, cache)`` variants where not every MoE layer's main piece fits:
        the first ``split`` MoE layers (as many as fit beside the least expert cache) split at their
        experts, the others run whole; and none split, without an expert cache."""
        budget = math.inf if self.budget is None else self.budget
        in_order = sorted(self.moe, key=lambda n: self.model[n].layer)
        options = []
        for whole in (True, False):
            self._stream_whole_moe(whole)
            minimum = workspace + self.ring_bytes()
            for kv_on_gpu in self._kv_choices():
                room = budget - minimum - (kv if kv_on_gpu else 0)
                if room < 0:
                    continue
                options.append((0, whole, kv_on_gpu, 0))
                split = 0
                while split < len(in_order) and \
                        split_router_bytes(self.model, in_order[:split + 1]) + least_cache <= room:
                    split += 1
                if split:
                    options.append((split, whole, kv_on_gpu, least_cache))
        return options

    def _use(self, whole: bool, cache: int, split: int | None = None) -> None:
        """Plan the variant: whole-layer slots or not, the expert cache's bytes, and the first ``split``
        MoE layers split at their experts (None: all)."""
        in_order = sorted(self.moe, key=lambda n: self.model[n].layer)
        self.moe_split = set(in_order if split is None else in_order[:split])
        self._stream_whole_moe(whole)
        self.expert_cache = cache
        slots = cache // max(expert_slot_bytes(self.model), 1)
        self.estimator = Estimator(self.model, self.profile, expert_hit_rate=uniform_hit_rate(self.model, slots),
                                   costs=self.estimator._cache,
                                   sizes=self.sizes)

    def _experts_mix(self, tier: int, pinned: set[str], kv_on_gpu: bool) -> Placement:
        """MoE layers split between experts on the CPU and cached experts so both finish together."""
        est = self.estimator
        choice, cpu_total, copy_total = {}, 0.0, 0.0
        for name in sorted(self.moe_split - pinned, key=lambda n: self.model[n].layer):
            sublayer = self.model[name]
            cpu_s = est.experts_s(sublayer, "cpu", tier, contended=True)
            copy_s = self.profile.transfer_s(est.expert_miss_bytes(sublayer, tier), "h2d", True)
            if cpu_total + cpu_s <= copy_total + copy_s:
                choice[name], cpu_total = "experts-host", cpu_total + cpu_s
            else:
                choice[name], copy_total = "experts-cache", copy_total + copy_s
        return self._family("experts-mix", pinned, kv_on_gpu, lambda s: choice.get(s.name, "stream"))

    def _zero_copy_share(self, tier: int, pinned: set[str], kv_on_gpu: bool) -> float:
        """The CPU's share of a ``tier`` step's host experts beside the GPU's zero-copy kernels: of
        each token's experts, the count whose step (routed experts on the host, the rest streamed)
        the estimator prices fastest, as a share the executor turns back into that count
        (:func:`~vramshard.runtime.zero_copy_experts.cpu_expert_count`): 1 is all of them on the CPU,
        none read by the kernels. The counts tried are none and all, every count between them only
        where asked for (:data:`PLANS_SHARES`). 0 unless the kernels read host experts at this tier
        and the executor hands the CPU's share to its run-ahead worker: on the host thread every
        share made decode slower on the H200 machine (fourteenth and sixteenth GPU sessions), and
        the estimator does not see why."""
        est = self.estimator
        if not (self.moe_split and est.zero_copy and est.run_ahead and tier <= est.zero_copy_rows):
            return 0.0
        host = self._family("experts-cpu", pinned, kv_on_gpu,
                            lambda s: "experts-host" if s.name in self.moe_split else "stream")
        top_k = min(self.model[n].top_k for n in self.moe)
        saved, seconds = est.zero_copy_cpu_share, {}
        try:
            for count in range(top_k + 1) if PLANS_SHARES else (0, top_k):
                est.zero_copy_cpu_share = count / top_k
                seconds[count] = self._time(host, tier)
                if seconds[count] > min(seconds.values()) * (1 + SHARE_TIE):
                    break  # past the fastest: the step is the slower of two sides, one rising with the count
        finally:
            est.zero_copy_cpu_share = saved
        best = min(seconds, key=seconds.get)
        return best / top_k if seconds[best] < seconds[0] * (1 - SHARE_TIE) else 0.0
