"""Planning a vision-language model under a budget: the language model is planned with room for
the vision phase beside it, on the real Qwen2.5-VL-7B shapes (no weights are made: planning only
reads shapes)."""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path

import pytest

from vramshard import vlm
from vramshard.models import build_model
from vramshard.models.base import Model
from vramshard.plan import calibrate
from vramshard.plan.tiers import Tiers
from vramshard.profile import load
from vramshard.runtime import budget as budgets
from vramshard.shapes import shape_config

GiB = 2**30
PIXELS_1440P = 2560 * 1440
CONTEXT = 5120
H200_PROFILE = Path(__file__).resolve().parent.parent / "docs" / "profiles" / "h200-cold.json"


@pytest.fixture(scope="module")
def vl7b():
    return build_model(shape_config("qwen2.5-vl-7b"))


@pytest.fixture(scope="module")
def h200_profile():
    return load(H200_PROFILE, check_fingerprint=False)


def planning_engine(model, profile, budget: int, max_step_tokens: int):
    """What ``vlm._vision_plans`` reads of an engine: the model, the KV plan, the plan settings."""
    tiers = Tiers(tuple(t for t in Tiers().sizes if t <= max_step_tokens))
    settings = budgets.PlanSettings(profile, tiers, CONTEXT, 2, "qwen2.5-vl-7b")
    executor = types.SimpleNamespace(kv_plan=(1, CONTEXT), host={}, budget=budget)
    return types.SimpleNamespace(model=model, executor=executor, max_step_tokens=max_step_tokens,
                                 model_name="qwen2.5-vl-7b", args=model.args,
                                 budget=types.SimpleNamespace(plan_settings=lambda: settings))


@pytest.mark.parametrize("options", [
    vlm.VisionOptions(offload_weights=False),
    vlm.VisionOptions(free_before_prefill=False),
    vlm.VisionOptions(),
], ids=["no_offload", "no_free_before_prefill", "all_on"])
@pytest.mark.parametrize("gib,step_tokens", [(4, 1024), (8, 2048)])
def test_the_vision_phase_and_the_language_model_fit_the_budget_together(vl7b, h200_profile, options, gib,
                                                                          step_tokens, monkeypatch):
    """The plan for a 1440p image's vision phase beside the language model fits the budget (the
    8 GiB `no_offload` plan of the sixth GPU session needed 8.02 GiB: it re-planned the language
    model with the same slack under the budget three times and gave up over it)."""
    monkeypatch.setattr(vlm, "splits_ffns", lambda sublayers, host: True)  # host FFNs packed split-ready
    budget = gib * GiB
    options = dataclasses.replace(options, plan_pixels=PIXELS_1440P)
    patches = PIXELS_1440P // vl7b.args.vision.patch_size ** 2
    engine = planning_engine(vl7b, h200_profile, budget, step_tokens)
    plans, plan_set = vlm._vision_plans(engine, options, patches, h200_profile, budget)
    need = vlm._vision_need(engine, plans, patches, options, plan_set.num_slots)
    assert need <= budget, f"planned {need / GiB:.3f} GiB under {gib} GiB"
    assert plans.tiers[-1] == vlm.VISION_TIER


def test_when_the_vision_phase_cannot_fit_the_plan_leaving_it_most_room_is_kept(vl7b, monkeypatch):
    """2 GiB, 1024-token chunks, a 1440p image without free-before-prefill (the seventh GPU
    session's queued-load profile): no language-model plan leaves the vision phase enough room.
    The first shrink asked the planner for less than the language model's minimum, and the plan
    at the full budget was kept (its vision phase needs 2.75 GiB). Halving back towards the last
    budget that planned finds the host-KV plan with nothing resident (2.10 GiB): the most pixels
    fit, and larger images get the clear error."""
    monkeypatch.setattr(vlm, "splits_ffns", lambda sublayers, host: True)
    profile = load(H200_PROFILE.parent / "h200-queued.json", check_fingerprint=False)
    options = dataclasses.replace(vlm.VisionOptions(free_before_prefill=False), plan_pixels=PIXELS_1440P)
    patches = PIXELS_1440P // vl7b.args.vision.patch_size ** 2
    engine = planning_engine(vl7b, profile, 2 * GiB, 1024)
    plans, plan_set = vlm._vision_plans(engine, options, patches, profile, 2 * GiB)
    need = vlm._vision_need(engine, plans, patches, options, plan_set.num_slots)
    assert 2 * GiB < need < 2.2 * GiB, need / GiB
    assert plans.tiers[-1] == vlm.VISION_TIER


def test_the_calibration_times_a_vision_language_models_steps_without_its_vision_encoder(vl7b, h200_profile,
                                                                                           monkeypatch):
    """The engine's calibration estimates the plan in force with the whole model, vision encoder
    included, while the language model's plans do not place the encoder (the eleventh GPU session:
    a KeyError on `vision.patch_embed` once a budget change re-planned a vision-language model)."""
    monkeypatch.setattr(vlm, "splits_ffns", lambda sublayers, host: True)
    options = dataclasses.replace(vlm.VisionOptions(), plan_pixels=PIXELS_1440P)
    patches = PIXELS_1440P // vl7b.args.vision.patch_size ** 2
    engine = planning_engine(vl7b, h200_profile, 4 * GiB, 1024)
    _, plan_set = vlm._vision_plans(engine, options, patches, h200_profile, 4 * GiB)
    names = {name for name, _ in plan_set.tiers[256].placement.where}
    assert not any(name.startswith("vision") for name in names)
    whole = calibrate.step_seconds(vl7b, h200_profile, plan_set, 256)
    language_model = Model(vl7b.args, [s for s in vl7b if s.kind != "vision"], vl7b.dtype)
    text = calibrate.step_seconds(language_model, h200_profile, plan_set, 256)
    assert whole == pytest.approx(text)


@pytest.mark.parametrize("link_codec", [None, False])
def test_the_vision_phase_plans_price_the_link_as_the_engine_crosses_it(vl7b, h200_profile, monkeypatch, link_codec):
    """With the link codec switched on, the language model's plans beside the vision phase price coded fills unless
    the engine decided its host cannot hold them (``PlanSettings.wire_codec`` False)."""
    from vramshard.plan import planner
    from vramshard.plan.mechanisms import wire_codec_enabled

    monkeypatch.setenv("VRAMSHARD_WIRE_CODEC", "on")
    monkeypatch.setattr(vlm, "splits_ffns", lambda sublayers, host: True)
    priced = []

    class Planner(planner.Planner):
        def __init__(self, *args, **kwargs):
            priced.append(wire_codec_enabled())
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(planner, "Planner", Planner)
    engine = planning_engine(vl7b, h200_profile, 8 * GiB, 1024)
    settings = dataclasses.replace(engine.budget.plan_settings(), wire_codec=link_codec)
    engine.budget.plan_settings = lambda: settings
    options = dataclasses.replace(vlm.VisionOptions(), plan_pixels=PIXELS_1440P)
    vlm._vision_plans(engine, options, PIXELS_1440P // vl7b.args.vision.patch_size ** 2, h200_profile, 8 * GiB)
    assert priced and all(p is (link_codec is None) for p in priced)
