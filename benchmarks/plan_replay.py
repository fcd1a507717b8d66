"""Plans and predictions replayed from a stored machine profile, without a GPU: what the planner
and the estimator say for the shapes the GPU sessions measured. Planning is arithmetic on the
profile, so this runs on any machine; the figures of docs/BENCHMARKS.md's "Changed after the
sixth session" come from it.

    PYTHONPATH=src python -m benchmarks.plan_replay dense [--contended-factor 4]
    PYTHONPATH=src python -m benchmarks.plan_replay tiers          # nemo-8b, the engine's default tiers
    VRAMSHARD_CHUNK_ATTENTION=mask PYTHONPATH=src python -m benchmarks.plan_replay tiers
    PYTHONPATH=src python -m benchmarks.plan_replay vlm
    PYTHONPATH=src python -m benchmarks.plan_replay moe
    PYTHONPATH=src python -m benchmarks.plan_replay cache          # the expert cache's Python bookkeeping
    PYTHONPATH=src python -m benchmarks.plan_replay calibrate --result docs/results-planner-nemo-run7.json \
        --profile docs/profiles/h200-queued.json                       # in-situ CPU calibration, replayed
    PYTHONPATH=src python -m benchmarks.plan_replay copies --profile docs/profiles/h100-run40.json \
        --cpu-scale 1.69 --copies-gbps 43                              # copies priced beside CPU reads
    PYTHONPATH=src python -m benchmarks.plan_replay baselines --result docs/results-nemo-decode-run33.json \
        --profile docs/profiles/h200-run33.json                        # the layers:N cells' steps, predicted
    PYTHONPATH=src python -m benchmarks.plan_replay batch --profile docs/profiles/h100-run40.json \
        --cpu-scale 1.76 --compute-rows 64:2.0,512:2.0 --packed 64:1.2  # a slower host's CPU, as checked
    PYTHONPATH=src python -m benchmarks.plan_replay step --profile docs/profiles/h100-run40.json --cpu-scale 1.19 \
        --compute-rows 16:1.26,64:0.96,512:0.89 --cpu-factor 1.36 --copies-gbps 45  # a step's inputs as measured
    PYTHONPATH=src python -m benchmarks.plan_replay fills --profile docs/profiles/h100-run60.json  # fills' issue priced
    PYTHONPATH=src python -m benchmarks.plan_replay staged --profile docs/profiles/h100-quick-run63.json  # 64 x 1K
    PYTHONPATH=src python -m benchmarks.plan_replay moe --profile docs/profiles/h200-queued.json --moe-finalists 1

``--profile`` (default docs/profiles/h200-cold.json, the fifth session's H200 profile).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import random
import time
import types
from pathlib import Path

import torch

GiB = 2**30
DEFAULT_PROFILE = Path(__file__).resolve().parent.parent / "docs" / "profiles" / "h200-cold.json"


def load_profile(path, contended_factor: float = 1.0):
    """The stored profile; ``contended_factor`` scales its contended CPU matmul times (a what-if)."""
    from vramshard.profile import load
    from vramshard.profile.query import Profile

    profile = load(path, check_fingerprint=False)
    if contended_factor == 1.0:
        return profile
    data = copy.deepcopy(profile.data)
    for table in data["matmul"]:
        if table.get("contended"):
            table["seconds"] = [[t * contended_factor for t in row] for row in table["seconds"]]
    return Profile(data)


def copies(args) -> None:
    """llama3-8b's tier-1 plans at 2, 4 and 8 GiB (CPU times x``--cpu-scale``, as an engine scales them to
    its host's read) with the profile's host→device copies beside CPU work as stored and at
    ``--copies-gbps``: family, prediction, CPU and copy time, bytes streamed, and the ``layers:N``
    baseline's prediction. Session 53's what-if: the stored profiles priced those copies at their alone
    rate (the profiler's CPU load stayed in L3), where the shared-read check saw 43 GB/s."""
    from vramshard.plan.estimator import Estimator
    from vramshard.plan.memory import sublayer_triples
    from vramshard.plan.placement import named_placement
    from vramshard.plan.planner import Planner
    from vramshard.plan.tiers import Tiers
    from vramshard.profile.query import Profile
    from vramshard.shapes import shape_model

    model = shape_model("llama3-8b")
    stored = load_profile(args.profile)
    cases = (("as stored", None), (f"copies beside CPU work at {args.copies_gbps:g} GB/s", args.copies_gbps))
    for label, gbps in cases:
        data = copy.deepcopy(stored.data)
        if gbps:
            for table in data["transfer"]:
                if table["contended"] and table["direction"] == "h2d":
                    table["seconds"] = [max(s, b / (gbps * 1e9)) for b, s in zip(table["bytes"], table["seconds"])]
        profile = Profile(data).calibrated(cpu_scale=args.cpu_scale)
        for gib, layers in ((2, 2), (4, 7), (8, 17)):
            tier = Planner(model, profile, gib * GiB, context=1088, tiers=Tiers((1, 64))).plan().tiers[1]
            step = Estimator(model, profile).simulate(tier.placement, 1, 1088)
            baseline = named_placement(f"layers:{layers}", sublayer_triples(model), model.args.num_hidden_layers)
            base = Estimator(model, profile).simulate(baseline, 1, 1088)
            print(f"{label}: {gib} GiB tier 1 {tier.family} {tier.predicted_s * 1e3:.1f} ms "
                  f"(CPU {step.cpu_busy * 1e3:.1f}, copies {step.copy_busy * 1e3:.1f}, "
                  f"{step.bytes_streamed / 1e9:.2f} GB streamed); layers:{layers} {base.seconds * 1e3:.1f} ms")


def step(args) -> None:
    """One plan's decode step priced again with the CPU and the copies at the rates a GPU session measured: the
    planner's tier-1 plan for llama3-8b at ``--budget`` GiB on the profile scaled as the engine scaled it
    (``--cpu-scale``, ``--compute-rows``), decode graphs priced, then the same placement with its CPU times a further
    x``--cpu-factor`` and its copies beside CPU work at ``--copies-gbps``, each alone and both. Session 59's what-if:
    is the estimator's step right where its inputs are (the fifty-fourth GPU session's planned:8 step ran 50.5-52.1 ms,
    priced 36.1, its CPU parts 1.36-1.42x their price, its copies at ~45 GB/s)?"""
    from vramshard.plan.estimator import Estimator
    from vramshard.plan.mechanisms import pricing_graphs
    from vramshard.plan.planner import Planner
    from vramshard.plan.tiers import Tiers
    from vramshard.profile.drift import COPY_SIZE, scaled_copies
    from vramshard.shapes import shape_model

    model = shape_model("llama3-8b")
    rows = {int(m): float(f) for m, f in (item.split(":") for item in args.compute_rows.split(",") if item)}
    stored = load_profile(args.profile)
    profile = stored.calibrated(cpu_scale=args.cpu_scale, compute_rows=rows or None)
    with pricing_graphs(True):
        tier = Planner(model, profile, int(args.budget * GiB), context=1088, tiers=Tiers((1,))).plan().tiers[1]
        copy_s = COPY_SIZE / (args.copies_gbps * 1e9)  # (as the engine's copy check would find it)
        for label, cpu, copies in (("as planned", 1.0, False), (f"CPU x{args.cpu_factor:g}", args.cpu_factor, False),
                                   (f"copies at {args.copies_gbps:g} GB/s", 1.0, True),
                                   ("both", args.cpu_factor, True)):
            priced = stored.calibrated(cpu_scale=args.cpu_scale * cpu, compute_rows=rows or None)
            priced = scaled_copies(priced, copy_s) if copies else priced
            est = Estimator(model, priced).simulate(tier.placement, 1, 1088)
            print(f"{args.budget:g} GiB tier 1 {tier.family}, {label}: {est.seconds * 1e3:.1f} ms (CPU "
                  f"{est.cpu_busy * 1e3:.1f}, copies {est.copy_busy * 1e3:.1f}, GPU {est.gpu_busy * 1e3:.1f})")


def fills(args) -> None:
    """llama3-8b's tier-1 and tier-64 plans at 2, 4 and 8 GiB (the profile's CPU times x``--cpu-scale``), decode
    graphs priced and the link coded, with the host's issue of each stream fill priced (the profile's ``fill_issue``,
    else the H100's figures at its dispatch cost: session 62) and with it free: family, prediction, the step's fills'
    issue on the host, and the predicted step of the other pricing's plan."""
    import dataclasses

    from vramshard.plan.estimator import Estimator
    from vramshard.plan.mechanisms import Mechanisms, fixed_mechanisms
    from vramshard.plan.planner import Planner
    from vramshard.plan.tiers import Tiers
    from vramshard.profile.query import Profile
    from vramshard.shapes import shape_model

    model = shape_model("llama3-8b")
    stored = load_profile(args.profile)
    nothing = {"graph": 1e-12, "graph_round": 1e-12, "round": 1e-12}
    priced = stored.calibrated(cpu_scale=args.cpu_scale)
    free = Profile(dict(copy.deepcopy(stored.data), fill_issue=nothing)).calibrated(cpu_scale=args.cpu_scale)
    mechanisms = dataclasses.replace(Mechanisms.here(), cpu_gemv=True, cpu_packed=True, wire_codec=True,
                                     decode_graphs=True, fill_graphs=True, amx=False)  # (as beside a GPU)
    with fixed_mechanisms(mechanisms):
        for gib in (2, 4, 8):
            plans = {label: Planner(model, profile, gib * GiB, context=1088, tiers=Tiers((1, 64))).plan()
                     for label, profile in (("priced", priced), ("free", free))}
            for tier in (1, 64):
                a, b = plans["priced"].tiers[tier], plans["free"].tiers[tier]
                est = Estimator(model, priced)
                where = a.placement.as_dict()
                issue = sum(est.fill_issue_s(model[name], where[name]) for name in a.placement.names(home="stream"))
                other = est.simulate(b.placement, tier, 1088).seconds
                print(f"{gib} GiB tier {tier}: fills priced {a.family} {a.predicted_s * 1e3:.1f} ms "
                      f"({len(a.placement.names(home='stream'))} fills, {issue * 1e3:.2f} ms of host issue); "
                      f"free {b.family} {b.predicted_s * 1e3:.1f} ms, that plan priced {other * 1e3:.1f} ms"
                      f"{'' if a.placement == b.placement else ' (another plan)'}")


def batch(args) -> None:
    """llama3-8b's tier-64 plan at 8 GiB (64 sequences at 40 tokens of context, engine_bench's batch-64 decode)
    against ``layers:17``, with the profile's CPU times x``--cpu-scale`` (the read's scale) and the compute
    check's factors (``--compute-rows``, ``--packed``: rows:factor,...) as an engine on a host unlike the
    profile's would price them: family, prediction, CPU and copy time, and the baseline's prediction."""
    from vramshard.plan.estimator import Estimator
    from vramshard.plan.mechanisms import Mechanisms, fixed_mechanisms
    from vramshard.plan.memory import sublayer_triples
    from vramshard.plan.placement import named_placement
    from vramshard.plan.planner import Planner
    from vramshard.plan.tiers import Tiers
    from vramshard.shapes import shape_model

    def by_rows(text: str) -> dict[int, float]:
        return {int(m): float(f) for m, f in (item.split(":") for item in text.split(",") if item)}

    model = shape_model("llama3-8b")
    profile = load_profile(args.profile).calibrated(cpu_scale=args.cpu_scale,
                                                    compute_rows=by_rows(args.compute_rows) or None)
    if args.packed:
        profile = profile.with_packed_now(model.dtype, by_rows(args.packed))
    rows, context = 64, 40
    for packed in (False, True):  # the executor packs beside a GPU (VRAMSHARD_CPU_PACKED=auto), tiles off there
        with fixed_mechanisms(dataclasses.replace(Mechanisms.here(), cpu_packed=packed, amx=False)):
            plan = Planner(model, profile, 8 * GiB, context=rows * context, tiers=Tiers((1, rows))).plan()
            estimator = Estimator(model, profile, threads=plan.tiers[rows].threads)
        tier = plan.tiers[rows]
        step = estimator.simulate(tier.placement, rows, context)
        baseline = named_placement("layers:17", sublayer_triples(model), model.args.num_hidden_layers)
        base = estimator.simulate(baseline, rows, context)
        print(f"packing {'on' if packed else 'off'}: tier {rows} {tier.family} {tier.predicted_s * 1e3:.1f} ms (CPU "
              f"{step.cpu_busy * 1e3:.1f}, copies {step.copy_busy * 1e3:.1f}; {tier.placement.summary()}); "
              f"layers:17 {base.seconds * 1e3:.1f} ms: {base.seconds / tier.predicted_s:.2f}x")


def dense(args) -> None:
    """nemo-8b's tier-1 plans at 2 and 8 GiB (step_profile's ``planned:G``): family, prediction,
    and where the bytes go."""
    from vramshard.plan.planner import Planner
    from vramshard.plan.tiers import Tiers
    from vramshard.shapes import shape_model

    model = shape_model("nemo-8b")
    profile = load_profile(args.profile, args.contended_factor)
    for gib in (2, 8):
        plan = Planner(model, profile, gib * GiB, context=1024 + 64, tiers=Tiers((1,))).plan()
        tier = plan.tiers[1]
        estimate = plan_estimate(model, profile, tier)
        print(f"nemo-8b {gib} GiB: {tier.family}, predicted {tier.predicted_s * 1e3:.1f} ms; CPU busy "
              f"{estimate.cpu_busy * 1e3:.1f} ms, copy engine {estimate.copy_busy * 1e3:.1f} ms, "
              f"{estimate.bytes_streamed / 1e9:.2f} GB streamed")


def plan_estimate(model, profile, tier):
    from vramshard.plan.estimator import Estimator

    return Estimator(model, profile, threads=tier.threads).simulate(tier.placement, 1, 1024 + 64)


def tiers(args) -> None:
    """nemo-8b under the engine's default tiers (steps up to 2048 tokens) at 2 and 4 GiB."""
    from vramshard.errors import BudgetError
    from vramshard.plan.planner import Planner
    from vramshard.plan.tiers import Tiers
    from vramshard.shapes import shape_model

    model = shape_model("nemo-8b")
    profile = load_profile(args.profile)
    for gib in (2, 4):
        try:
            plan = Planner(model, profile, gib * GiB, context=4096, tiers=Tiers()).plan()
        except BudgetError as exc:
            print(f"nemo-8b {gib} GiB: refused: {exc}")
            continue
        print(f"nemo-8b {gib} GiB: {plan.need.breakdown()}; tier 1 predicted {plan.tiers[1].predicted_s * 1e3:.1f} ms")


def vlm(args) -> None:
    """Qwen2.5-VL-7B's plans for a 1440p image beside the language model, per budget, prompt chunk
    and vision option set (what ``vlm.configure`` plans; host FFNs packed split-ready)."""
    from vramshard import vlm as vision
    from vramshard.errors import BudgetError
    from vramshard.models import build_model
    from vramshard.plan.memory import tiered_vram_need
    from vramshard.plan.tiers import Tiers
    from vramshard.runtime import budget as budgets
    from vramshard.shapes import shape_config

    model = build_model(shape_config("qwen2.5-vl-7b"))
    profile = load_profile(args.profile)
    vision.splits_ffns = lambda sublayers, host: True
    pixels, context = 2560 * 1440, 5120
    options = {"all_on": vision.VisionOptions(), "no_offload": vision.VisionOptions(offload_weights=False),
               "no_free_before_prefill": vision.VisionOptions(free_before_prefill=False)}
    for gib, chunk in ((2, 256), (2, 1024), (4, 2048), (8, 2048)):
        settings = budgets.PlanSettings(profile, Tiers(tuple(t for t in Tiers().sizes if t <= chunk)), context, 2,
                                        "qwen2.5-vl-7b")
        for name, option in options.items():
            option = dataclasses.replace(option, plan_pixels=pixels)
            engine = types.SimpleNamespace(
                model=model, executor=types.SimpleNamespace(kv_plan=(1, context), host={}, budget=gib * GiB),
                max_step_tokens=chunk, model_name="qwen2.5-vl-7b", args=model.args,
                budget=types.SimpleNamespace(plan_settings=lambda s=settings: s))
            patches = pixels // model.args.vision.patch_size ** 2
            try:
                plans, plan_set = vision._vision_plans(engine, option, patches, profile, gib * GiB)
            except BudgetError as exc:
                print(f"{gib} GiB, {chunk}-token chunks, {name}: refused: {exc}")
                continue
            need = tiered_vram_need(model, plans, 1, context, chunk, plan_set.num_slots)
            phase = vision._vision_need(engine, plans, patches, option, plan_set.num_slots)
            print(f"{gib} GiB, {chunk}-token chunks, {name}: peak of the phases {phase / GiB:.3f} GiB; "
                  f"{need.breakdown()}")


def moe(args) -> None:
    """qwen3-30b-a3b: the planner's tier-1 choice at 8 and 16 GiB, and the estimate of
    ``experts-stream`` with moe_bench's 12.5 GiB cache at uniform and measured hit rates."""
    from vramshard.plan.estimator import Estimator, uniform_hit_rate
    from vramshard.plan.memory import expert_slot_bytes, moe_layers, sublayer_triples
    from vramshard.plan.placement import named_placement
    from vramshard.plan.planner import Planner
    from vramshard.plan.tiers import Tiers
    from vramshard.shapes import shape_model

    from vramshard.plan import moe_variants

    model = shape_model("qwen3-30b-a3b")
    profile = load_profile(args.profile)
    moe_variants.FINALISTS = args.moe_finalists
    for gib in (8, 16):
        began = time.perf_counter()
        plan = Planner(model, profile, gib * GiB, context=2064, tiers=Tiers((1, 4, 16, 64, 256, 1024))).plan()
        took = time.perf_counter() - began
        tier = plan.tiers[1]
        shown = {k: round(v * 1e3, 1) for k, v in tier.candidates.items() if v != float("inf")}
        print(f"qwen3-30b-a3b {gib} GiB: {tier.family}, expert cache {plan.expert_cache / GiB:.2f} GiB, KV cache on "
              f"the {'GPU' if plan.kv_on_gpu else 'CPU'}; predicted ms {shown}; planned in {took:.2f} s "
              f"({args.moe_finalists} variant(s) planned in full)")
    stream = named_placement("experts-stream", sublayer_triples(model), model.args.num_hidden_layers,
                             moe_layers=moe_layers(model))
    slots = int(12.5 * GiB) // expert_slot_bytes(model)
    for hit in (uniform_hit_rate(model, slots), args.hit_rate):
        estimate = Estimator(model, profile, expert_hit_rate=hit).simulate(stream, 1, 1024)
        print(f"experts-stream, 12.5 GiB cache, hit rate {hit:.2f}: {estimate.seconds * 1e3:.1f} ms "
              f"(copy engine {estimate.copy_busy * 1e3:.1f} ms, GPU {estimate.gpu_busy * 1e3:.1f} ms)")


def staged(args) -> None:
    """llama3-8b at 64 sequences of 1K context (step_profile's ``--seqs 64``): the planner's tier-1 and tier-64 plans at
    2 and 8 GiB (mechanisms as beside a GPU: decode graphs, the link coded, no tiles), and the tier-64 CPU attention
    sub-layer's price through the C kernel sequence by sequence and as a padded batch (session 63)."""
    import dataclasses

    from vramshard.plan.estimator import Estimator
    from vramshard.plan.mechanisms import Mechanisms, fixed_mechanisms, pricing_graphs
    from vramshard.plan.planner import Planner
    from vramshard.plan.tiers import Tiers
    from vramshard.shapes import shape_model

    model = shape_model("llama3-8b")
    profile = load_profile(args.profile)
    rows, context = 64, 64 * 1088
    mechanisms = dataclasses.replace(Mechanisms.here(), cpu_gemv=True, cpu_packed=True, wire_codec=True,
                                     decode_graphs=True, fill_graphs=True, amx=False)
    with fixed_mechanisms(mechanisms), pricing_graphs(True):
        for gib in (2, 8):
            plan = Planner(model, profile, gib * GiB, context=context, tiers=Tiers((1, rows))).plan()
            for tier in (1, rows):
                t = plan.tiers[tier]
                print(f"{gib} GiB tier {tier}: {t.family} {t.predicted_s * 1e3:.1f} ms ({t.placement.summary()})")
    attention = next(s for s in model if s.kind == "attn")
    for kernel in (True, False):
        seconds = Estimator(model, profile, cpu_gemv=kernel).compute_s(attention, "cpu", rows, context)
        print(f"tier {rows} CPU attention sub-layer, {'C kernel by sequence' if kernel else 'padded batch'}: "
              f"{seconds * 1e3:.1f} ms")


def cache(args) -> None:
    """Microseconds of the expert cache's Python bookkeeping per MoE layer at decode (gather 8 of
    128 experts, build the row table, release), with a copier that does nothing."""
    from vramshard.runtime.expert_cache import ExpertCache

    class NoCopies:
        def fill(self, slot, name, expert):
            return 1

        def ready(self, slot):
            pass

        def done(self, slot):
            pass

        def view(self, slot, name):
            return None

    expert_cache = ExpertCache(1300, NoCopies())
    names = [f"ffn[{i}]" for i in range(48)]
    rng = random.Random(0)
    steps = 200
    start = time.perf_counter()
    for _ in range(steps):
        for name in names:
            ids = sorted(rng.sample(range(128), 8))
            slots = expert_cache.gather(name, ids)
            torch.tensor([slots[e] for e in ids])
            expert_cache.release(slots.values())
    per_layer = (time.perf_counter() - start) / steps / len(names)
    print(f"expert cache bookkeeping: {per_layer * 1e6:.1f} us a layer (hit rate {expert_cache.stats.hit_rate:.2f})")


def calibrate(args) -> None:
    """A planner_bench result replayed with the engine's in-situ calibration: per cell, the profile
    fitted to the chosen plan's measured step (:func:`vramshard.plan.calibrate.fit`, as the engine
    fits it), every other measured family's prediction under it against its measurement, and the
    plan the planner chooses then."""
    import json

    from vramshard.budget_follower import CALIBRATE_OFF_BY
    from vramshard.plan.calibrate import fit, step_seconds
    from vramshard.plan.planner import Planner
    from vramshard.plan.tiers import Tiers
    from vramshard.shapes import shape_model

    result = json.loads(Path(args.result).read_text())
    bench, models = result["args"], result["models"]
    profile = load_profile(args.profile)
    tiers = Tiers(tuple(int(t) for t in bench["tiers"].split(",")))
    within = {"before": 0, "after": 0, "of": 0}
    for name, entry in models.items():
        model = shape_model(name)
        for gib in sorted({c["budget_gib"] for c in entry["cells"]}):
            budget = int(gib * GiB)
            plan = Planner(model, profile, budget, context=bench["ctx"], tiers=tiers).plan()
            for cell in (c for c in entry["cells"] if c["budget_gib"] == gib):
                tier, measured = cell["tier"], cell["measured_ms"]
                tier_plan = plan.tiers[tier]
                chosen = tier_plan.family
                if chosen != cell["chosen"] or chosen not in measured:
                    print(f"{name} {gib:g} GiB tier {tier}: the plan differs from the stored one; skipped")
                    continue
                ratio = measured[chosen] / cell["predicted_ms"][chosen]
                if 1 / CALIBRATE_OFF_BY <= ratio <= CALIBRATE_OFF_BY:
                    print(f"{name} {gib:g} GiB tier {tier}: {chosen} measured {ratio:.2f}x its prediction; "
                          "within the engine's tolerance, not fitted")
                    continue
                fitted = fit(model, profile, plan, measured[chosen] / 1e3, tier)
                if fitted is None:
                    print(f"{name} {gib:g} GiB tier {tier}: {chosen} gives nothing to fit")
                    continue
                rows = []
                for family, ms in sorted(measured.items(), key=lambda kv: kv[1]):
                    if family == chosen:
                        continue
                    alone = dataclasses.replace(tier_plan, placement=tier_plan.placements[family], threads=None)
                    family_plan = dataclasses.replace(plan, tiers={tier: alone})
                    before = cell["predicted_ms"][family]
                    after = step_seconds(model, fitted.profile, family_plan, tier) * 1e3
                    within["of"] += 1
                    within["before"] += abs(before - ms) <= 0.15 * ms
                    within["after"] += abs(after - ms) <= 0.15 * ms
                    rows.append(f"{family} {ms:.0f} ms {(before - ms) / ms:+.0%} -> {(after - ms) / ms:+.0%}")
                again = Planner(model, fitted.profile, budget, context=bench["ctx"], tiers=tiers).plan().tiers[tier]
                same = [f for f in measured if tier_plan.placements[f].where == again.placement.where]
                verdict = (f"{same[0]}'s placement, measured {measured[same[0]]:.0f} ms; fastest measured "
                           f"{min(measured.values()):.0f} ms" if same else "a placement not measured")
                print(f"{name} {gib:g} GiB tier {tier}: {fitted.what} {fitted.value:.4g} fitted to {chosen} "
                      f"({measured[chosen]:.0f} ms, predicted {cell['predicted_ms'][chosen]:.0f}). Other families, "
                      f"error before -> after: {'; '.join(rows) or 'none'}. Re-planned: {again.family} ({verdict})")
    print(f"other families within 15%: {within['before']}/{within['of']} before, {within['after']}/{within['of']} after")


def baselines(args) -> None:
    """The estimator's decode step for each named-placement cell (``layers:N``) of an ``engine_bench``
    JSON against the step the cell measured, with ``--profile`` scaled as the run scaled it (the
    ``xN.NN`` its profile source names). On the profile of the machine that ran the cell this tells
    whether the planner priced the baseline it had to beat, apart from its own plan."""
    import json
    import re

    from vramshard.plan.estimator import Estimator
    from vramshard.plan.memory import sublayer_triples
    from vramshard.plan.placement import named_placement
    from vramshard.shapes import shape_model

    result = json.loads(Path(args.result).read_text())
    profile = load_profile(args.profile)
    scale = re.search(r"CPU times x([0-9.]+)", result.get("profile") or "")
    if scale:
        profile = profile.calibrated(float(scale.group(1)))
    context = result["args"]["pp"] + result["args"]["tg"] // 2
    for name, entry in result["models"].items():
        model = shape_model(name)
        layers = sum(1 for s in model if s.kind == "attn")
        fits = [fit for cell in entry["cells"] if cell.get("engine") == "vramshard"
                for fit in cell.get("calibrations") or () if fit.get("cpu_rows") or fit.get("split_rows")]
        for cell in entry["cells"]:
            placement = cell.get("placement") or ""
            if not placement.startswith("layers:") or not cell.get("decode_step_ms_median"):
                continue
            named = named_placement(placement, sublayer_triples(model), layers)
            predicted = Estimator(model, profile).simulate(named, 1, context, 2).seconds * 1e3
            measured = cell["decode_step_ms_median"]
            print(f"{name} {placement} at {cell['vram'] / GiB:g} GiB: predicted {predicted:.1f} ms, measured "
                  f"{measured:.1f} ms ({predicted / measured - 1:+.0%})")
            # ... its batched decode steps (B sequences' next tokens), the step and the host's CPU work in it
            for size, run in sorted((cell.get("batched") or {}).items(), key=lambda item: int(item[0])):
                if not run.get("decode_step_ms_median") or not run.get("decode_host_compute_ms_median"):
                    continue
                rows = int(size)
                batch_context = result["args"].get("batch_prompt", 16) + result["args"].get("batch_gen", 16) // 2
                estimate = Estimator(model, profile).simulate(named, rows, batch_context, 2)
                print(f"    batch {rows}: predicted step {estimate.seconds * 1e3:.1f} ms (CPU work "
                      f"{estimate.cpu_busy * 1e3:.1f}), measured {run['decode_step_ms_median']:.1f} ms (CPU work "
                      f"{run['decode_host_compute_ms_median']:.1f}: "
                      f"{estimate.cpu_busy * 1e3 / run['decode_host_compute_ms_median'] - 1:+.0%})")
            # ... and as the planned engine's fits priced it when it re-planned (the factors by rows it fitted)
            for fit in fits:
                rows = {int(m): f for m, f in (fit.get("cpu_rows") or {}).items()}
                split = {int(m): f for m, f in (fit.get("split_rows") or {}).items()}
                fitted = profile.with_fitted_factors({**profile.fitted_factors(), "cpu_rows": sorted(rows.items()),
                                                      "split_rows": sorted(split.items())})
                seconds = Estimator(model, fitted).simulate(named, 1, context, 2).seconds * 1e3
                print(f"    with the engine's fit cpu_rows {rows} split_rows {split}: predicted {seconds:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("dense", "tiers", "vlm", "moe", "cache", "calibrate", "baselines",
                                                   "copies", "batch", "step", "fills", "staged"))
    parser.add_argument("--profile", default=str(DEFAULT_PROFILE))
    parser.add_argument("--contended-factor", type=float, default=1.0,
                        help="scale the profile's contended CPU matmul times (a what-if)")
    parser.add_argument("--copies-gbps", type=float, default=43.0,
                        help="copies: host-to-device GB/s beside CPU work (a what-if)")
    parser.add_argument("--cpu-scale", type=float, default=1.0, help="copies: the profile's CPU times scaled by this")
    parser.add_argument("--cpu-factor", type=float, default=1.0, help="step: the CPU times a further x this")
    parser.add_argument("--budget", type=float, default=8.0, help="step: GiB")
    parser.add_argument("--compute-rows", default="", help="batch: the compute check's factors, rows:factor,...")
    parser.add_argument("--packed", default="", help="batch: prepacked over plain timed now, rows:factor,...")
    parser.add_argument("--hit-rate", type=float, default=0.42, help="the measured expert-cache hit rate")
    parser.add_argument("--moe-finalists", type=int, default=2,
                        help="moe: the variants the quick plans rank first that are planned in full")
    parser.add_argument("--result", default=None,
                        help="calibrate: a planner_bench JSON; baselines: an engine_bench JSON")
    args = parser.parse_args()
    if args.what in ("calibrate", "baselines") and not args.result:
        parser.error(f"{args.what} needs --result: a planner_bench JSON (calibrate) or an engine_bench one (baselines)")
    {"dense": dense, "tiers": tiers, "vlm": vlm, "moe": moe, "cache": cache, "calibrate": calibrate,
     "baselines": baselines, "copies": copies, "batch": batch, "step": step, "fills": fills,
     "staged": staged}[args.what](args)


if __name__ == "__main__":
    main()
