"""The planner: a pinned set under the VRAM budget, then for each token tier the fastest
placement of the other sub-layers among the plan families, as predicted by the estimator.

Families (over the sub-layers not pinned):
  gpu-only  every streamable sub-layer streamed to the GPU (prompt chunks, big batches);
  static    attention on the GPU (beside its KV cache, or over a host KV cache staged through
            VRAM), FFN and head on the CPU;
  dynamic   streaming and CPU compute balanced so PCIe and the CPU finish together;
  cpu       everything not pinned on the CPU;
  split     the best of the above with every free dense FFN split into pieces between the CPU
            and streaming (``Where.cpu_pieces``), the number of CPU pieces spread evenly over the
            layers and chosen so the CPU and the copy engine finish together: each layer then
            overlaps its CPU part with the copy of the next layer's GPU part;
  search    a per-sub-layer local search started from the best family (it also moves split
            FFNs one piece at a time).

MoE models add (their FFN split at the experts, the main piece in VRAM: norm, router and any
shared expert; where not every MoE layer's main piece fits, the first layers split as far as
theirs fit and the others stream whole or run on the CPU):
  experts-cpu     routed experts computed on the CPU (llama.cpp --cpu-moe);
  experts-stream  routed experts copied into the VRAM expert cache (only those it lacks);
  experts-mix     MoE layers split between the two so the CPU and PCIe finish together;
and choose between slots sized for whole MoE layers (whole-layer streaming) or not, and the
expert cache's size against pinned sub-layers (a few sizes tried, at the hit rate uniform
routing gives, a floor for real routers). Where the GPU's kernels read host experts from pinned
memory at decode sizes and the executor has its run-ahead worker, a decode tier also gets the
share of each token's host experts the CPU computes beside the kernels (``zero_copy_cpu_share``):
the whole count of experts whose step the estimator prices fastest.

With the KV cache in host memory, attention may still compute on the GPU, streamed or pinned,
over its host KV cache staged through a one-layer VRAM cache (``Where.kv == "host"``): prompt
chunks gain most (CPU attention projections are compute-bound); every family, the balance and
the search consider it per tier, costed with its staging copies.

Where the planning process's mechanisms allow it (``VRAMSHARD_VRAM_CODEC``, bf16 weights), the pinned set is
also chosen with its attention and dense FFNs kept coded in VRAM (``Where.coded``, about 0.754 of their bytes,
:mod:`~vramshard.runtime.vram_coded`): about a third more of the model pinned, each coded sub-layer decoded
into a stream slot every step on its own stream. A share of them may be coded (the decodes are free only while
the step's other work is longer: :meth:`Planner._coded_variant`); the variant predicted faster over the tiers
is taken.

The KV cache lives in VRAM, in host memory, or (dense models, ``VRAMSHARD_KV_SPLIT=on``), where the
whole of it does not fit beside the weights worth pinning, split by layer: the attention layers pinned in VRAM
keep their caches beside them, each pinned layer counting its cache against the budget, and the
others' stay in host memory (as llama.cpp's ``-ngl`` keeps the caches of the layers it offloads).
The variant predicted fastest over the tiers is taken.
"""

from __future__ import annotations

import logging
import math

from ..env import switch
from ..errors import BudgetError
from ..layers.mlp import DenseFFN
from ..layers.moe import MoEFFN
from ..models.base import Model
from ..profile.query import Profile
from ..units import format_bytes
from ..runtime.vram_coded import codes as vram_codes
from .estimator import Estimator
from .mechanisms import vram_codec_enabled
from .memory import (VramNeed, coded_vram_bytes, kv_positions, kv_staging_bytes, split_router_bytes,
                     sublayer_packed_bytes, wire_staging_bytes, workspace_bytes)
from .moe_variants import MoEVariants
from .placement import (CPU, EXPERTS_CACHED, EXPERTS_CPU, GPU_CODED, GPU_CODED_HOST_KV, GPU_RESIDENT,
                        GPU_RESIDENT_HOST_KV, GPU_STREAMED, GPU_STREAMED_HOST_KV, Placement, TieredPlacement, Where,
                        split_ffn)
from .plan_set import WORKER_TEAM_ROWS, PinReason, PlanSet, TierPlan
from .tiers import Tiers

log = logging.getLogger(__name__)
FAMILIES = ("gpu-only", "static", "dynamic", "cpu", "split", "search")
MOE_FAMILIES = FAMILIES + ("experts-cpu", "experts-stream", "experts-mix")
# A plan without streaming slots wins unless one with them is predicted this much faster: streaming
# shares host memory and PCIe with whatever else runs (a game), and the estimator has priced copies
# hidden under a step that were not (docs/BENCHMARKS.md, eighteenth GPU session).
STREAMING_TIE = 0.02
# Whether the KV cache may be split by layer (pinned attention's in VRAM, the others' in host memory):
# off unless VRAMSHARD_KV_SPLIT=on. Its one GPU run (docs/BENCHMARKS.md, fortieth GPU session: llama3-8b
# at 4 GiB, the split chosen) decoded at 0.89x layers:7 with its CPU work at 2.1x its prediction, the whole
# cache at 1.00x on another machine. In the A/B on one machine (call_session45b.sh, forty-first GPU session)
# the planner never split at those hosts' CPU scales (1.9-2.1): no gain shown, so it stays off.
KV_SPLIT = switch("VRAMSHARD_KV_SPLIT", False)
# Shares of the codable sub-layers (VRAMSHARD_VRAM_CODEC) the coded variant of the pinned set offers coded.
CODED_SHARES = (0.25, 0.5, 0.75, 1.0)
__all__ = ["FAMILIES", "MOE_FAMILIES", "WORKER_TEAM_ROWS", "PinReason", "PlanSet", "Planner", "TierPlan",
           "machine_profile"]


class Planner(MoEVariants):
    """Plans ``model`` on the machine described by ``profile`` under ``budget`` bytes of VRAM
    (a MoE model's variants in :class:`~.moe_variants.MoEVariants`)."""

    def __init__(self, model: Model, profile: Profile, budget: int | None, context: int = 4096,
                 tiers: Tiers = Tiers(), kv_slots: int = 1, num_slots: int = 2, name: str = "model",
                 kv_on_gpu: bool | None = None, split_ffns: bool = True, search: bool = True,
                 kv_split: bool | None = None):
        self.model = model
        self.profile = profile
        self.budget = budget
        self.context = context
        self.tiers = tiers
        self.kv_slots = kv_slots
        self.num_slots = num_slots
        self.name = name
        # None: the planner chooses where the KV cache lives; True / False: it must be in VRAM / host
        # memory (a running engine whose KV caches already live there, or that cannot move them).
        self.kv_on_gpu = kv_on_gpu
        self.split_ffns = split_ffns  # whether dense FFNs may be split between the CPU and streaming
        # whether the KV cache may be split by layer (None: VRAMSHARD_KV_SPLIT, KV_SPLIT)
        self.kv_split = KV_SPLIT if kv_split is None else kv_split
        # False: no per-sub-layer search (a plan in ~0.1 s instead of ~1 s, predicted within a few
        # percent on the 8B shapes): what a budget that just shrank needs, before a full plan.
        self.search = search
        self.sizes = {s.name: sublayer_packed_bytes(model, s.name) for s in model}
        self.estimator = Estimator(model, profile, sizes=self.sizes)
        # Slots are sized for attention/FFN sub-layers: the embedding and the head (often the
        # largest tensors) are never streamed, they are pinned or computed on the CPU.
        self.streamable = [s.name for s in model if s.kind in ("attn", "ffn")]
        self.slot_bytes = max((self.sizes[n] for n in self.streamable), default=0)
        self.moe = {s.name for s in model if isinstance(s, MoEFFN)}
        self.expert_cache = 0  # bytes, for the variant being planned
        # With the KV cache in host memory: whether attention may run on the GPU over it (the VRAM
        # staging cache fits), for the variant being planned.
        self.stage_attention = False
        self.staging = kv_staging_bytes(model, kv_slots, context)
        # With the KV cache in host memory: whether pinned attention layers keep theirs in VRAM beside
        # them (as llama.cpp's -ngl keeps the KV cache of the layers it offloads), for the variant being planned.
        self.kv_beside_pinned = False
        # The MoE FFNs that split at their experts (main pieces in VRAM), for the variant being planned:
        # all, but where their main pieces do not fit (large shared experts) as many as fit, the
        # others running whole (streamed or on the CPU).
        self.moe_split = set(self.moe)
        self.moe_fixed = split_router_bytes(model, self.moe)  # main pieces of every MoE layer (one buffer)
        # Sub-layers that may be pinned coded (VRAMSHARD_VRAM_CODEC, bf16): attention and dense FFNs, which a
        # stream slot holds (and whose coded buffer, rounded as the allocator rounds it, is the smaller).
        self.codable = [s.name for s in model if s.kind in ("attn", "ffn") and s.name not in self.moe
                        and coded_vram_bytes(self.sizes[s.name]) < self.sizes[s.name]] \
            if vram_codes(model.dtype, vram_codec_enabled()) else []
        self.coded_pins: set[str] = set()  # those the variant being planned pins coded (candidates while it chooses)


    def ring_bytes(self) -> int:
        """VRAM of the streaming slots, sized for the largest streamable sub-layer, with the staging buffer
        of coded link fills where the link is priced coded (as :func:`~.memory.vram_need` counts them)."""
        return self.num_slots * self.slot_bytes + wire_staging_bytes(self.model)

    # ------------------------------------------------------------------ public
    def plan(self) -> PlanSet:
        plans = self._plan()
        team = self.profile.worker_team(self.model.dtype) if plans.tiered().uses_gpu else None
        if team is not None and self.estimator.run_ahead:
            plans.worker_team = team
            plans.notes.append(f"run-ahead worker: {team} CPU threads for steps of up to {WORKER_TEAM_ROWS} tokens "
                               f"(the profile's fastest team for a one-token expert pass beside the host thread)")
        return plans

    def _plan(self) -> PlanSet:
        if not self.profile.has_gpu:
            return self._all_cpu("no GPU: every sub-layer runs on the CPU")
        if self.moe:
            return self._plan_moe()
        workspace = workspace_bytes(self.model, self.tiers.largest, self.context, kv_slots=self.kv_slots)
        kv = self.kv_bytes()
        slots = self.ring_bytes()
        minimum = workspace + slots
        if self.budget is not None and self.budget < minimum:
            raise BudgetError(
                f"a VRAM budget of {format_bytes(self.budget)} is below the minimum of {format_bytes(minimum)} "
                f"(workspace for {self.tiers.largest}-token steps {format_bytes(workspace)}, "
                f"{self.num_slots} streaming slots {format_bytes(slots)}); raise --vram to at least "
                f"{format_bytes(minimum)}, lower the largest tier, or plan for the CPU only (--device cpu)"
            )
        options = []
        if self.kv_on_gpu is not False and (self.budget is None or self.budget >= minimum + kv):
            options.append(self._plan_variant(kv_on_gpu=True, workspace=workspace, kv=kv, search=self.search))
        if self.kv_on_gpu is not True:
            options.append(self._plan_variant(kv_on_gpu=False, workspace=workspace, kv=0, search=self.search))
        if self.kv_split and self.kv_on_gpu is None and self.budget is not None \
                and sum(self.sizes.values()) + workspace + kv > self.budget:
            # Part of the KV cache in VRAM: beside the attention layers pinned there (the others' in host memory);
            # an option where it pins some attention (else it is a plan with the KV cache on the CPU).
            split = self._plan_variant(kv_on_gpu=False, workspace=workspace, kv=0, search=self.search,
                                       kv_beside_pinned=True)
            if split.kv_layers_in_vram:
                options.append(split)
        if not options:
            raise self._kv_forced_error(minimum + kv)
        best = min(options, key=self._score)
        first = self.tiers.sizes[0]
        if self.kv_on_gpu is not None:
            best.notes.append(f"KV cache on the {'GPU' if self.kv_on_gpu else 'CPU'}: placed there by the caller")
        elif len(options) > 1:
            others = "; ".join(f"{other.tiers[first].predicted_s * 1e3:.2f} ms with it {other.kv_side}"
                               for other in options if other is not best)
            best.notes.append(f"KV cache {best.kv_side}: predicted tier-{first} step "
                              f"{best.tiers[first].predicted_s * 1e3:.2f} ms vs {others}")
        else:
            best.notes.append("KV cache on the CPU: it does not fit beside the minimum in the budget")
        return best

    def _kv_choices(self) -> tuple[bool, ...]:
        return (True, False) if self.kv_on_gpu is None else (self.kv_on_gpu,)

    def _kv_forced_error(self, needed: int) -> BudgetError:
        return BudgetError(
            f"the KV cache must stay in VRAM, but a budget of {format_bytes(self.budget)} is below the "
            f"{format_bytes(needed)} it needs with the minimum beside it; raise --vram or let the KV cache "
            "move to host memory (kv_on_gpu=None or False)")

    def kv_bytes(self) -> int:
        """The KV cache of every layer for ``kv_slots`` sequences of ``context`` tokens, each rounded up
        to whole blocks as the paged cache allocates them (:func:`~vramshard.plan.memory.vram_need`)."""
        return self.model.args.num_hidden_layers * self.layer_kv_bytes()

    def layer_kv_bytes(self) -> int:
        """One attention layer's share of :meth:`kv_bytes`."""
        a = self.model.args
        return 2 * kv_positions(self.kv_slots, self.context) * a.num_key_value_heads * a.head_dim \
            * self.model.dtype.itemsize

    def _pin_bytes(self, sublayer) -> int:
        """VRAM that pinning ``sublayer`` takes: its weights, and an attention layer's KV cache where
        pinned attention keeps it beside it (``kv_beside_pinned``)."""
        kv = self.layer_kv_bytes() if sublayer.kind == "attn" and self.kv_beside_pinned else 0
        return self._resident_bytes(sublayer.name) + kv

    def _resident_bytes(self, name: str) -> int:
        """VRAM the weights of ``name`` take pinned: coded where the variant being planned pins it coded."""
        return coded_vram_bytes(self.sizes[name]) if name in self.coded_pins else self.sizes[name]

    # ------------------------------------------------------------------ variants
    def _score(self, plan: PlanSet) -> float:
        """Sum over tiers of predicted time relative to the tier size (seconds per token)."""
        return sum(p.predicted_s / t for t, p in plan.tiers.items())

    def _plan_variant(self, kv_on_gpu: bool, workspace: int, kv: int, search: bool = True,
                      kv_beside_pinned: bool = False) -> PlanSet:
        """The plan with the KV cache in VRAM (``kv_on_gpu``, ``kv`` bytes of it) or in host memory;
        ``kv_beside_pinned``: in host memory but for the attention layers pinned in VRAM, whose KV
        caches stay beside them (``kv`` 0: each pinned attention layer counts its own)."""
        self.kv_beside_pinned = kv_beside_pinned and not kv_on_gpu
        try:
            return self._plan_kv_variant(kv_on_gpu, workspace, kv, search)
        finally:
            self.kv_beside_pinned = False

    def _plan_kv_variant(self, kv_on_gpu: bool, workspace: int, kv: int, search: bool) -> PlanSet:
        budget = math.inf if self.budget is None else self.budget
        everything = sum(self.sizes.values())
        staging = 0 if kv_on_gpu else self.staging
        if everything + workspace + kv <= budget and not self.kv_beside_pinned:
            # Attention stays beside its KV cache: on the CPU when the cache is in host memory (this
            # variant then only runs when the caller forces the KV cache there; no slots to stream with).
            pinned, reasons = [s.name for s in self.model if kv_on_gpu or s.kind != "attn"], []
            self.stage_attention = False
            return self._planned(kv_on_gpu, workspace, kv, 0, pinned, reasons, None, search)
        slots = self.ring_bytes()
        room = budget - workspace - kv - slots - self._moe_reserved()
        self.stage_attention = not kv_on_gpu and room >= staging
        room -= staging if self.stage_attention else 0
        pinned, reasons = self._choose_pinned(room, kv_on_gpu, search)
        streaming = self._planned(kv_on_gpu, workspace, kv, slots, pinned, reasons, self._pin_note, search)
        coded = self._coded_variant(kv_on_gpu, workspace, kv, slots, room, search)
        if coded is not None:
            with_codes, without = self._score(coded), self._score(streaming)
            verdict = "kept coded in VRAM" if with_codes < without else "not coded: raw pins predicted faster"
            winner = coded if with_codes < without else streaming
            winner.notes.append(
                f"pinned set {verdict} ({len(coded.coded_names)} coded sub-layers, "
                f"{format_bytes(sum(self.sizes[n] for n in coded.pinned))} of weights pinned in "
                f"{format_bytes(coded.need.resident)}; predicted {with_codes * 1e3:.2f} against "
                f"{without * 1e3:.2f} ms per token summed over tiers raw)")
            streaming = winner
        unstreamed = self._unstreamed_variant(kv_on_gpu, workspace, kv, budget, search)
        if unstreamed is None or self._score(unstreamed) > self._score(streaming) * (1 + STREAMING_TIE):
            return streaming
        unstreamed.notes.append(
            f"no streaming slots: the {format_bytes(slots)} they would take holds pinned weights instead "
            f"(predicted {self._score(unstreamed) * 1e3:.2f} against {self._score(streaming) * 1e3:.2f} ms per "
            "token summed over tiers with streaming)")
        return unstreamed

    def _coded_variant(self, kv_on_gpu: bool, workspace: int, kv: int, slots: int, room: float,
                       search: bool) -> PlanSet | None:
        """The plan whose pinned set is chosen with some of its attention and dense FFNs kept coded in VRAM
        (each priced at its coded bytes, the decode into its slot a cost of pinning it); None where nothing
        may be coded (the switch off, not bf16) or nothing coded was pinned.

        How much to code: each share of :data:`CODED_SHARES` of the codable sub-layers (FFNs first: most of
        the bytes and the least time saved per byte; then attention) is tried, its pinned set chosen and its
        tiers priced without search, and the fastest share planned in full. The decodes run on their own
        stream, free while the step's other work is longer; past that each costs its time, so on a GPU with
        slow memory a part coded can beat both all and none."""
        if not self.codable:
            return None
        ranked = sorted(self.codable, key=lambda name: self.model[name].kind != "ffn")  # (stable: model order)
        trials = []
        try:
            for share in CODED_SHARES:
                candidates = set(ranked[: max(1, round(share * len(ranked)))])
                self.coded_pins = candidates
                pinned, reasons = self._choose_pinned(room, kv_on_gpu, search)
                self.coded_pins = {name for name in pinned if name in candidates}
                if not self.coded_pins:
                    continue
                predicted = sum(self._plan_tier(t, set(pinned), kv_on_gpu, search=False).predicted_s / t
                                for t in self.tiers.sizes)
                trials.append((predicted, share, pinned, reasons, self._pin_note, self.coded_pins))
            best = None
            # The search moves the prices of shares apart: the two best without it are planned in full.
            for _, share, pinned, reasons, note, self.coded_pins in sorted(trials, key=lambda t: t[0])[:2 if search else 1]:
                plan = self._planned(kv_on_gpu, workspace, kv, slots, pinned, reasons, note, search)
                if best is None or self._score(plan) < self._score(best[1]):
                    best = (share, plan)
            if best is None:
                return None
            share, plan = best
            plan.notes.append(f"coded pins: {share:.0%} of the codable sub-layers offered coded, of "
                              f"{', '.join(f'{s:.0%}' for s in CODED_SHARES)} (the two fastest without search planned)")
            return plan
        finally:
            self.coded_pins = set()

    def _unstreamed_variant(self, kv_on_gpu: bool, workspace: int, kv: int, budget: float,
                            search: bool) -> PlanSet | None:
        """The plan with no streaming slots: their VRAM pins weights, and what is not pinned runs
        on the CPU. None where it cannot run: MoE layers (their experts stream), or attention
        beside a GPU KV cache left out of VRAM (it can only stream).

        With slots reserved, a budget a little short of every weight streams a few sub-layers
        through slots that would have held them: nemo-8b at 16 GiB and 5K context streamed two
        FFNs (540 MiB of slots for 540 MiB of FFNs), 41 ms per decode step against 18 ms with
        everything but the embedding pinned (docs/BENCHMARKS.md, eighteenth GPU session)."""
        if self.moe:
            return None
        streamable, staged = self.streamable, self.stage_attention
        self.streamable, self.stage_attention = [], False  # nothing streams: the unpinned run on the CPU
        try:
            pinned, reasons = self._choose_pinned(budget - workspace - kv, kv_on_gpu, search)
            if kv_on_gpu and any(s.kind == "attn" and s.name not in pinned for s in self.model):
                return None
            return self._planned(kv_on_gpu, workspace, kv, 0, pinned, reasons, self._pin_note, search)
        finally:
            self.streamable, self.stage_attention = streamable, staged

    def _planned(self, kv_on_gpu: bool, workspace: int, kv: int, slots: int, pinned: list[str],
                 reasons: list[PinReason], note: str | None, search: bool) -> PlanSet:
        """The plan of every tier over ``pinned``, with its VRAM need and notes."""
        tiers = {t: self._plan_tier(t, set(pinned), kv_on_gpu, search) for t in self.tiers.sizes}
        if self.kv_beside_pinned:
            kv = self.layer_kv_bytes() * sum(1 for s in self.model if s.kind == "attn" and s.name in pinned)
        staged = any(p.placement.staged_kv_names() for p in tiers.values())
        # (split FFNs stream too; sub-layers pinned coded are decoded into the ring's slots)
        streams = any(p.placement.names(home="stream") or p.placement.coded_names() for p in tiers.values())
        split = {n for p in tiers.values() for n in p.placement.expert_names()}
        caches = any(p.placement.expert_names("cache") for p in tiers.values())
        routers = split_router_bytes(self.model, split)
        need = VramNeed(resident=sum(self._resident_bytes(n) for n in pinned), slots=slots if streams else 0,
                        kv=kv, workspace=workspace, experts=routers + (self.expert_cache if caches else 0),
                        kv_staging=self.staging if staged else 0)
        plan = PlanSet(self.name, self.budget, self.context, kv_on_gpu or kv > 0, self.num_slots, need, pinned, reasons,
                       tiers, expert_cache=self.expert_cache if caches else 0,
                       expert_hit_rate=self.estimator.expert_hit_rate if caches else 0.0,
                       pinned_weight_bytes=sum(self.sizes[n] for n in pinned))
        if self.kv_beside_pinned and kv > 0:
            plan.kv_layers_in_vram = kv // self.layer_kv_bytes()
        if note:
            plan.notes.append(note)
        return plan



    def _choose_pinned(self, room: float, kv_on_gpu: bool, compare: bool) -> tuple[list[str], list[PinReason]]:
        """The pinned set of the two greedy orders (see :meth:`_pinned_set`) whose plan the
        estimator predicts faster, over all tiers (without the per-sub-layer search)."""
        by_score = self._pinned_set(room, kv_on_gpu)
        self._pin_note = None
        if not compare:
            return by_score
        fixed_first = self._pinned_set(room, kv_on_gpu, fixed_first=True)
        if fixed_first[0] == by_score[0]:
            return by_score

        def predicted(pinned: list[str]) -> float:
            return sum(self._plan_tier(t, set(pinned), kv_on_gpu, search=False).predicted_s / t
                       for t in self.tiers.sizes)

        seconds = [predicted(by_score[0]), predicted(fixed_first[0])]
        best = 0 if seconds[0] <= seconds[1] else 1
        self._pin_note = (f"pinned set: {'by time saved per byte' if best == 0 else 'stream-only attention first'} "
                          f"(predicted {seconds[best] * 1e3:.2f} vs {seconds[1 - best] * 1e3:.2f} ms per token "
                          "summed over tiers, without search)")
        return (by_score, fixed_first)[best]

    def _pinned_set(self, room: float, kv_on_gpu: bool, fixed_first: bool = False) -> tuple[list[str], list[PinReason]]:
        """Greedy by step time saved per byte, summed over tiers relative to each tier's step.

        ``fixed_first``: pin first the sub-layers that can only stream when left out of VRAM
        (attention beside a GPU KV cache). Per-byte scores see each sub-layer
        alone; in a step where the CPU and the copy engine share the unpinned work, a sub-layer
        that can only use the copy engine costs more than its score says, because FFNs that
        could run on either side absorb the balance.
        """
        est = self.estimator
        candidates = []
        baseline = {}
        for tier in self.tiers.sizes:
            baseline[tier] = sum(self._unpinned_s(s, tier, kv_on_gpu) for s in self.model
                                 if s.kind != "vision") or 1.0
        for sublayer in self.model:
            if sublayer.kind == "vision":
                continue  # never runs in a token step; vlm.configure plans the vision phase
            host_kv = sublayer.kind == "attn" and not kv_on_gpu and not self.kv_beside_pinned  # (pinned, staged)
            if host_kv and not self.stage_attention:
                continue  # attention runs beside its KV cache, on the CPU here
            saved = {}
            for tier in self.tiers.sizes:
                pinned_s = est.compute_s(sublayer, "cuda", tier, self.context) + est.launch_s(sublayer, "cuda", tier)
                if sublayer.name in self.coded_pins:
                    pinned_s += est.decode_s(sublayer)  # (on its own stream: an upper price)
                if host_kv:
                    pinned_s += self._staging_s(sublayer, tier)
                saved[tier] = max(0.0, self._unpinned_s(sublayer, tier, kv_on_gpu) - pinned_s)
            nbytes = self._pin_bytes(sublayer)
            score = sum(saved[t] / baseline[t] for t in saved) / max(nbytes, 1) * 2**30
            candidates.append(PinReason(sublayer.name, nbytes, saved, score))
        stream_only = {s.name for s in self.model if s.kind == "attn" and s.name in self.streamable} if kv_on_gpu \
            else set()
        candidates.sort(key=lambda r: (fixed_first and r.name in stream_only, r.score), reverse=True)
        pinned, reasons, used = [], [], 0
        for reason in candidates:
            if reason.score > 0 and used + reason.nbytes <= room:
                pinned.append(reason.name)
                reasons.append(reason)
                used += reason.nbytes
        order = {s.name: i for i, s in enumerate(self.model)}
        pinned.sort(key=order.__getitem__)
        return pinned, reasons

    def _unpinned_s(self, sublayer, tier: int, kv_on_gpu: bool) -> float:
        """Cost of a sub-layer left out of VRAM: its cheaper of streaming and CPU compute."""
        est = self.estimator
        cpu = est.compute_s(sublayer, "cpu", tier, self.context) + est.launch_s(sublayer, "cpu", tier)
        if sublayer.kind == "attn":
            stream = max(est.copy_s(sublayer), est.compute_s(sublayer, "cuda", tier, self.context))
            if kv_on_gpu:
                return stream
            return min(cpu, stream + self._staging_s(sublayer, tier)) if self.stage_attention else cpu
        if sublayer.name in self.streamable:
            stream = max(est.copy_s(sublayer), est.compute_s(sublayer, "cuda", tier, self.context))
            return min(cpu, stream)
        return cpu

    def _staging_s(self, sublayer, tier: int) -> float:
        """Copy-engine time of staging a host KV cache for one step of GPU attention (in and out)."""
        prefix, new = self.estimator.staging_bytes(sublayer, tier, self.context)
        return self.profile.transfer_s(prefix, "h2d", True) + self.profile.transfer_s(new, "d2h", True)

    # ------------------------------------------------------------------ one tier
    def _plan_tier(self, tier: int, pinned: set[str], kv_on_gpu: bool, search: bool = True) -> TierPlan:
        if not self.streamable:  # a plan without streaming slots: the unpinned run on the CPU
            cpu = self._family("cpu", pinned, kv_on_gpu, lambda s: "cpu")
            times = dict.fromkeys(FAMILIES, math.inf)  # (MoE plans always stream: see _unstreamed_variant)
            times["cpu"] = self._time(cpu, tier)
            threads = self._best_threads(cpu, tier) if search else None
            return TierPlan(tier, "cpu", cpu, threads, times["cpu"], times, {"cpu": cpu},
                            cpu_packed=self.estimator.packs_at(tier))
        share = self._zero_copy_share(tier, pinned, kv_on_gpu)
        saved, self.estimator.zero_copy_cpu_share = self.estimator.zero_copy_cpu_share, share
        try:
            plan = self._plan_families(tier, pinned, kv_on_gpu, search)
        finally:
            self.estimator.zero_copy_cpu_share = saved
        if plan.placement.expert_names("host"):
            plan.zero_copy_cpu_share = share
        plan.cpu_packed = self.estimator.packs_at(tier)  # (as the estimator priced the tier)
        return plan


    def _plan_families(self, tier: int, pinned: set[str], kv_on_gpu: bool, search: bool) -> TierPlan:
        """The tier's fastest placement of the sub-layers not in ``pinned`` (module docstring)."""
        families = {
            "gpu-only": self._family("gpu-only", pinned, kv_on_gpu, lambda s: "stream"),
            "static": self._family("static", pinned, kv_on_gpu, lambda s: "stream" if s.kind == "attn" else "cpu"),
            "cpu": self._family("cpu", pinned, kv_on_gpu, lambda s: "cpu"),
            "dynamic": self._dynamic(tier, pinned, kv_on_gpu),
        }
        if self.moe_split:
            families["experts-cpu"] = self._family("experts-cpu", pinned, kv_on_gpu,
                                                   lambda s: "experts-host" if s.name in self.moe_split else "stream")
            if self.expert_cache:
                families["experts-stream"] = self._family("experts-stream", pinned, kv_on_gpu,
                                                          lambda s: "experts-cache" if s.name in self.moe_split else "stream")
                families["experts-mix"] = self._experts_mix(tier, pinned, kv_on_gpu)
        times = {name: self._time(p, tier) for name, p in families.items()}
        # The balance's greedy assignment can miss its own end points (everything on one side).
        for end in ("cpu", "gpu-only"):
            if times[end] < times["dynamic"]:
                families["dynamic"] = Placement("dynamic", families[end].where)
                times["dynamic"] = times[end]
        best_family = min(times, key=times.get)
        split = self._split(tier, families[best_family], pinned)
        times["split"] = math.inf
        if split is not None:
            families["split"], times["split"] = split
            best_family = min(times, key=times.get)
        searched = self._search(families[best_family], tier, pinned, kv_on_gpu, times[best_family]) if search \
            else families[best_family]
        families["search"] = searched
        times["search"] = self._time(searched, tier) if search else times[best_family]
        for name in (MOE_FAMILIES if self.moe else FAMILIES):
            times.setdefault(name, math.inf)
        winner = min((n for n in times if n in families), key=times.get)
        threads = self._best_threads(families[winner], tier) if search else None
        return TierPlan(tier, winner, families[winner], threads, times[winner], times, families)

    def _time(self, placement: Placement, tier: int) -> float:
        return self.estimator.simulate(placement, tier, self.context, self.num_slots).seconds

    def _where(self, sublayer, choice: str, pinned: set[str], kv_on_gpu: bool) -> Where:
        if sublayer.kind == "vision":
            return CPU  # token steps never run the vision encoder
        if sublayer.name in pinned:
            host_kv = sublayer.kind == "attn" and not kv_on_gpu and not self.kv_beside_pinned
            if sublayer.name in self.coded_pins:
                return GPU_CODED_HOST_KV if host_kv else GPU_CODED
            return GPU_RESIDENT_HOST_KV if host_kv else GPU_RESIDENT
        if sublayer.kind == "attn":
            if kv_on_gpu:
                return GPU_STREAMED
            # KV cache in host memory: attention on the CPU beside it, or on the GPU over it (staged).
            return GPU_STREAMED_HOST_KV if choice == "stream" and self.stage_attention else CPU
        if choice == "experts-host" and sublayer.name in self.moe_split:
            return EXPERTS_CPU
        if choice == "experts-cache" and sublayer.name in self.moe_split:
            return EXPERTS_CACHED
        if choice == "stream" and sublayer.name in self.streamable:
            return GPU_STREAMED
        return CPU

    def _family(self, name: str, pinned, kv_on_gpu, choose) -> Placement:
        return Placement(name, tuple((s.name, self._where(s, choose(s), pinned, kv_on_gpu)) for s in self.model))

    def _dynamic(self, tier: int, pinned: set[str], kv_on_gpu: bool) -> Placement:
        """Split the free sub-layers between PCIe and the CPU so both finish together (LPT)."""
        est = self.estimator
        staged = not kv_on_gpu and self.stage_attention  # attention may go either way, over host KV
        free = [s for s in self.model if s.name not in pinned and s.name in self.streamable
                and (s.kind != "attn" or staged)]
        fixed_cpu = sum(est.compute_s(s, "cpu", tier, self.context) for s in self.model
                        if s.name not in pinned and (s.name not in self.streamable
                                                     or (s.kind == "attn" and not kv_on_gpu and not staged)))
        fixed_copy = sum(est.copy_s(s) for s in self.model
                         if s.name not in pinned and s.kind == "attn" and kv_on_gpu)
        choice = {}
        cpu_total, copy_total = fixed_cpu, fixed_copy
        for s in sorted(free, key=lambda s: self.sizes[s.name], reverse=True):
            cpu_s = est.compute_s(s, "cpu", tier, self.context, contended=True)
            copy_s = est.copy_s(s, contended=True) + (self._staging_s(s, tier) if s.kind == "attn" else 0.0)
            if cpu_total + cpu_s <= copy_total + copy_s:
                choice[s.name], cpu_total = "cpu", cpu_total + cpu_s
            else:
                choice[s.name], copy_total = "stream", copy_total + copy_s
        return self._family("dynamic", pinned, kv_on_gpu, lambda s: choice.get(s.name, "cpu"))

    def _splittable(self, pinned: set[str]) -> list[DenseFFN]:
        """Dense FFNs the split may place: not pinned, streamable, in more than one piece."""
        if not self.split_ffns:
            return []
        return [s for s in self.model if isinstance(s, DenseFFN) and s.name not in pinned
                and s.name in self.streamable and s.num_pieces > 1]

    def _split(self, tier: int, base: Placement, pinned: set[str]) -> tuple[Placement, float] | None:
        """``base`` with every free dense FFN cut into pieces between the CPU and streaming.

        A total of K pieces goes to the CPU, spread evenly over the layers (so each layer overlaps
        the same CPU part with the next layer's copy); K starts at the fluid balance of CPU and
        copy-engine time (the rest of ``base`` as it is) and a few neighbours are simulated.
        Returns (placement, predicted seconds), or None when no FFN can be split.
        """
        free = self._splittable(pinned)
        if not free:
            return None
        est = self.estimator
        where = dict(base.where)
        names = {s.name for s in free}
        fixed_cpu = fixed_copy = 0.0
        for sublayer in self.model:
            w = where[sublayer.name]
            if sublayer.name in names or sublayer.kind == "vision":
                continue
            if w.compute == "cpu":
                fixed_cpu += est.compute_s(sublayer, "cpu", tier, self.context, contended=True)
            elif w.home == "stream":
                fixed_copy += est.copy_s(sublayer, contended=True)
        piece_cpu = sum(est.compute_s(s, "cpu", tier, self.context, contended=True) / s.num_pieces for s in free) / len(free)
        piece_copy = sum(est.copy_s(s, contended=True) / s.num_pieces for s in free) / len(free)
        total = sum(s.num_pieces for s in free)
        balance = (fixed_copy + total * piece_copy - fixed_cpu) / max(piece_cpu + piece_copy, 1e-12)
        step = max(1, len(free) // 2)
        candidates = sorted({min(total, max(0, round(balance) + d * step)) for d in range(-3, 4)})
        best = None
        for cpu_pieces in candidates:
            placement = Placement("split", tuple(where.items()))
            placement = self._spread(placement, free, cpu_pieces)
            seconds = self._time(placement, tier)
            if best is None or seconds < best[1]:
                best = (placement, seconds)
        return best

    @staticmethod
    def _spread(base: Placement, free: list[DenseFFN], cpu_pieces: int) -> Placement:
        """``base`` with ``cpu_pieces`` CPU pieces spread evenly over the FFNs ``free`` (model order)."""
        where = dict(base.where)
        n = len(free)
        for i, sublayer in enumerate(free):
            k = min(sublayer.num_pieces, (i + 1) * cpu_pieces // n - i * cpu_pieces // n)
            where[sublayer.name] = _pieces_where(sublayer, k)
        return Placement(base.name, tuple(where.items()))

    def _search(self, start: Placement, tier: int, pinned: set[str], kv_on_gpu: bool, best_s: float) -> Placement:
        """Flip single sub-layers between streaming and the CPU while the prediction improves; move
        split FFNs (and, once some FFN is split, any free dense FFN) one piece either way."""
        where = dict(start.where)
        pieces = {s.name: s for s in self._splittable(pinned)} if start.split_names() else {}
        split = {EXPERTS_CPU: EXPERTS_CACHED, EXPERTS_CACHED: EXPERTS_CPU} if self.expert_cache else {}
        staged = not kv_on_gpu and self.stage_attention  # attention: CPU <-> GPU over its host KV cache
        flippable = [s.name for s in self.model if s.name not in pinned and (s.kind != "attn" or staged)
                     and (s.name in self.streamable or where[s.name] in split)]
        kinds = {s.name: s.kind for s in self.model}
        for _ in range(3):
            improved = False
            for name in flippable:
                old = where[name]
                if name in pieces:  # one piece more or fewer on the CPU
                    sublayer = pieces[name]
                    k = old.cpu_pieces if old.split else (sublayer.num_pieces if old == CPU else 0)
                    for move in (-1, 1):
                        if not 0 <= k + move <= sublayer.num_pieces:
                            continue
                        where[name] = _pieces_where(sublayer, k + move)
                        seconds = self._time(Placement("search", tuple(where.items())), tier)
                        if seconds < best_s * 0.999:
                            best_s, improved = seconds, True
                            break
                        where[name] = old
                    continue
                if old in split:  # MoE split: experts on the CPU <-> in the expert cache
                    where[name] = split[old]
                elif kinds[name] == "attn":
                    where[name] = CPU if old == GPU_STREAMED_HOST_KV else GPU_STREAMED_HOST_KV
                else:
                    where[name] = CPU if old == GPU_STREAMED else GPU_STREAMED
                candidate = Placement("search", tuple(where.items()))
                seconds = self._time(candidate, tier)
                if seconds < best_s * 0.999:
                    best_s, improved = seconds, True
                else:
                    where[name] = old
            if not improved:
                break
        return Placement("search", tuple(where.items()))

    def _best_threads(self, placement: Placement, tier: int) -> int | None:
        """The CPU thread count of the tier's steps: fewer than all cores (None) only where the
        estimator prices that at least 2% faster. (Once the first count tried won every tie, and a
        tier whose only CPU sub-layer is the embedding ran its host experts on one thread.)"""
        if not placement.names(compute="cpu") and not placement.split_names() \
                and not placement.expert_names("host"):
            return None
        best, best_s = None, math.inf
        for threads in (None, *(t for t in self.profile.threads if t != self.profile.default_threads)):
            est = Estimator(self.model, self.profile, threads, self.estimator.expert_hit_rate, self.sizes,
                            costs=self.estimator._cache, zero_copy_cpu_share=self.estimator.zero_copy_cpu_share)
            seconds = est.simulate(placement, tier, self.context, self.num_slots).seconds
            if seconds < best_s * 0.98:
                best, best_s = threads, seconds
        return best

    def _all_cpu(self, note: str) -> PlanSet:
        placement = Placement("cpu", tuple((s.name, CPU) for s in self.model))
        tiers = {}
        for t in self.tiers.sizes:
            seconds = self._time(placement, t)
            tiers[t] = TierPlan(t, "cpu", placement, self._best_threads(placement, t), seconds, {"cpu": seconds},
                                {"cpu": placement}, cpu_packed=self.estimator.packs_at(t))
        return PlanSet(self.name, self.budget, self.context, False, 0, VramNeed(0, 0, 0, 0), [], [], tiers, [note])




def named_plan(model: Model, placement: Placement, profile: Profile, tiers: Tiers) -> TieredPlacement:
    """A named placement (``layers:N``, ``static``, ...: a person's choice, the same at every step size)
    as the executor should run it on this machine: its dense FFNs' CPU work read from prepacked weights
    only at the tiers where the profile finds packing pays (:meth:`Estimator.packs_at`), as a plan's
    are. A baseline that packed at every tier would run 4-15% slower than it can where packing does not
    pay (bf16 FFNs at 16 and 64 rows on the H100 and H200 hosts' profiles), pack in its tiers' first
    steps, and hold the packed copies beside the plain weights."""
    estimator = Estimator(model, profile)
    return TieredPlacement.every_tier(placement, tiers.sizes, tuple(estimator.packs_at(t) for t in tiers.sizes))


def _pieces_where(sublayer: DenseFFN, cpu_pieces: int) -> Where:
    """A dense FFN with ``cpu_pieces`` of its pieces on the CPU: streamed whole (0), on the CPU
    (all), split otherwise."""
    if cpu_pieces <= 0:
        return GPU_STREAMED
    if cpu_pieces >= sublayer.num_pieces:
        return CPU
    return split_ffn(cpu_pieces)


def machine_profile(path=None) -> Profile:
    """This machine's profile (``vramshard profile``); without one, rough defaults and a warning."""
    from ..profile import load, load_or_none, synthetic

    if path is not None:
        return load(path, check_fingerprint=False)
    profile = load_or_none()
    if profile is not None:
        return profile
    log.warning("no profile of this machine yet: planning with rough defaults; run `vramshard profile` "
                "once (about a minute with --quick) for plans fitted to this machine")
    import torch

    if torch.cuda.is_available():
        return synthetic(cpu_gflops=1000, gpu_gflops=100_000, h2d_gbps=25, cpu_mem_gbps=60, gpu_mem_gbps=1000)
    return synthetic(cpu_gflops=500, cpu_mem_gbps=40)
