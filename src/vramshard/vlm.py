"""Multimodal prompts: the vision phase, image embeddings in the prompt, multimodal rotary positions.

``Engine.logits`` / ``Engine.generate`` call here when they get ``pixel_values``. A
prompt's ids already hold the expanded image placeholders (one ``image_token_id`` per
image embedding, as the Hugging Face processor makes them). The steps:

1. the vision sub-layers run once over all images, through the executor like any
   other sub-layers (so they can be placed on the CPU, resident or streamed);
2. the prompt is prefilled with ``Step.input_embeds`` (the image embeddings replace the
   placeholder rows in ``embed``) and ``Step.rope_positions`` ([3, T] multimodal positions);
3. decoding continues with 1-D positions shifted by the prompt's rope delta.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator, Sequence

import torch

from .errors import BudgetError, InvalidInputError, VramshardError
from .layers.step import Step
from .layers.vision import VisionStep
from .loading.image import (IMAGE_PAD, IMAGE_PLACEHOLDER, ImageConfig, ImageSource, expand_image_tokens,
                            preprocess_images)
from .plan.memory import LOGIT_ROWS, tiered_vram_need, vision_workspace_bytes
from .plan.placement import CPU, GPU_RESIDENT, GPU_STREAMED, Placement, TieredPlacement
from .runtime.host_weights import splits_ffns
from .runtime.kv_cache import KVCache
from .runtime.request import MultimodalInput
from .runtime.sampler import SamplingParams
from .units import format_bytes

log = logging.getLogger(__name__)

LM_CAP = 1 << 62  # token steps never exceed this: the last language-model tier covers up to it
VISION_TIER = 1 << 63  # the tier the vision phase runs under (never chosen by a token step)


@dataclass(frozen=True)
class VisionOptions:
    """The three VRAM optimizations of the vision phase; each can be switched off to measure it.

    offload_weights: vision weights stay in host memory; each vision sub-layer streams to the GPU
        or runs on the CPU, whichever the estimator predicts faster for the images' patch count
        (off: the whole vision encoder resident in VRAM).
    memory_efficient_attention: fused attention kernels, long segments tiled over queries and the
        MLP over row chunks of ``mlp_rows``, so no patches x patches score matrix exists (off: the
        math kernel, which materializes the scores).
    free_before_prefill: the vision phase ends and gives its VRAM back before the language model
        allocates its KV cache, so the peak is the larger phase, not the sum (off: KV first).
    plan_pixels: image area (pixels, all images of a prompt) the vision phase is planned for.
    """

    offload_weights: bool = True
    memory_efficient_attention: bool = True
    free_before_prefill: bool = True
    mlp_rows: int = 4096
    plan_pixels: int = 1280 * 28 * 28

    @classmethod
    def all_off(cls) -> "VisionOptions":
        return cls(offload_weights=False, memory_efficient_attention=False, free_before_prefill=False)


@dataclass
class VisionSetup:
    """What :func:`configure` decided for an engine: its options, image preprocessing, vision tier."""

    options: VisionOptions = field(default_factory=VisionOptions)
    image_config: ImageConfig = field(default_factory=ImageConfig)
    vision_tier: bool = False  # the executor's placement has a tier for the vision phase


def vision_setup(engine) -> VisionSetup:
    """The engine's :class:`VisionSetup` (defaults until :func:`configure` sets one)."""
    return engine.vision or VisionSetup()


# ---------------------------------------------------------------------- configuring an engine
def load(path: str | Path, vram=None, device: str | None = None, vision: VisionOptions | None = None,
         image_config: ImageConfig | None = None, profile=None, **options):
    """``Engine.load`` for a vision-language model, then :func:`configure` (see there).

    image_config: preprocessing; default: the model directory's ``preprocessor_config.json``.
    """
    from .engine import Engine

    if profile is not None:
        options["profile"] = profile
    engine = Engine.load(path, vram=vram, device=device, **options)
    if image_config is None:
        image_config = ImageConfig.from_dir(path) if Path(path).is_dir() else ImageConfig()
    configure(engine, vision, image_config, profile)
    return engine


def configure(engine, vision: VisionOptions | None = None, image_config: ImageConfig | None = None,
              profile=None) -> None:
    """Set the engine's vision options and, on the GPU, re-place the model for them.

    The language model is re-planned without the vision sub-layers (they never run in a token
    step), leaving room in the budget for the vision phase of ``vision.plan_pixels``; the vision
    sub-layers get a tier of their own, sized by that patch count.
    """
    if not vision_names(engine.model):
        raise InvalidInputError(f"{engine.model_name} has no vision encoder; vision options need a "
                                "vision-language model such as Qwen2.5-VL")
    vision = vision or VisionOptions()
    setup = VisionSetup(vision, image_config or vision_setup(engine).image_config)
    executor = engine.executor
    if not executor.uses_gpu:
        engine.vision = setup
        return  # everything on the CPU: nothing to place
    from .plan.planner import machine_profile

    profile = profile or machine_profile()
    patches = max(1, vision.plan_pixels // engine.args.vision.patch_size ** 2)
    plan = engine.plan
    if plan is not None:  # planned: plan the language model alone, leaving room for the vision phase
        plans, plan = _vision_plans(engine, vision, patches, profile, executor.budget)
    else:  # a named placement: the vision phase is added to it
        plans = _with_vision(engine.model, executor.plans, vision, patches, profile)
    _rebuild_executor(engine, plans)  # raises, with the engine as it was, when the placement does not fit
    engine.vision, engine.plan = setup, plan
    setup.vision_tier = True
    log.info("vision phase: %s", plans.placements[-1].summary())


def plans_for_budget(engine, budget: int | None, kv_on_gpu: bool | None = None, profile=None):
    """(placements with the vision tier, the language model's plan set) for a configured
    vision-language engine under ``budget``: what :func:`configure` plans at load, for a budget
    that changed while the engine runs (``kv_on_gpu``: force the KV cache's side)."""
    from .plan.planner import machine_profile

    vision = vision_setup(engine).options
    patches = max(1, vision.plan_pixels // engine.args.vision.patch_size ** 2)
    return _vision_plans(engine, vision, patches, profile or machine_profile(), budget, kv_on_gpu)


VISION_PLAN_TRIES = 8  # language-model plans tried for room beside the vision phase
VISION_PLAN_STEP = 32 * 2**20  # budgets closer than this are not told apart


def _vision_plans(engine, vision: VisionOptions, patches: int, profile, budget: int | None,
                  kv_on_gpu: bool | None = None):
    """The language model planned under ``budget`` less what the vision phase of ``patches``
    patches needs beside it, then the vision tier added: (TieredPlacement, PlanSet)."""
    from .models.base import Model
    from .plan.planner import Planner

    model, executor = engine.model, engine.executor
    text = Model(model.args, [s for s in model if s.kind != "vision"], model.dtype, model.config)
    slots, ctx = executor.kv_plan
    settings = engine.budget.plan_settings()
    limit, chosen, least_over = budget, None, None
    planned_at, failed_at = None, None  # the last budget that planned, the last that did not
    for _ in range(VISION_PLAN_TRIES):
        try:
            with settings.pricing():
                plan_set = Planner(text, profile, budget, context=slots * ctx, tiers=settings.tiers,
                                   num_slots=settings.num_slots, name=engine.model_name, kv_on_gpu=kv_on_gpu,
                                   split_ffns=splits_ffns(list(model), executor.host)).plan()
        except BudgetError:
            if chosen is None:
                raise
            # Shrunk past what the language model needs: halve the step back towards the last
            # budget that planned (the smallest plan leaves the vision phase the most room).
            failed_at = budget
            if planned_at - failed_at < VISION_PLAN_STEP:
                break
            budget = (planned_at + failed_at) // 2
            continue
        plans = _with_vision(model, plan_set.tiered(), vision, patches, profile)
        over = _vision_need(engine, plans, patches, vision, plan_set.num_slots) - (limit or 0)
        if chosen is None or over <= least_over:  # ties: the later plan, with fewer resident weights
            chosen, least_over = (plans, plan_set), over
        if over <= 0 or budget is None:
            break
        planned_at = budget
        # The language model alone needs `text_need`, usually a little under the budget it was
        # planned for; shrinking that budget by `over` alone can leave the same slack and overshoot
        # again (the 8 GiB `no_offload` plan did), so the next plan gets `text_need - over`.
        text_need = tiered_vram_need(text, plan_set.tiered(), slots, ctx, engine.max_step_tokens,
                                     plan_set.num_slots).total
        budget = min(budget, text_need) - over  # fewer resident weights: room for the vision phase
        if failed_at is not None:
            budget = max(budget, (planned_at + failed_at) // 2)  # not below a budget known too small
        if budget <= 0:
            break
    return chosen  # the plan whose vision phase needs least (larger images get the clear error)


def _with_vision(model, base: TieredPlacement, vision: VisionOptions, patches: int, profile) -> TieredPlacement:
    """``base`` (any placement of the language model) plus the vision sub-layers: not run by token
    tiers (CPU, or resident when not offloaded), and a vision tier placing each as the estimator says."""
    from .plan.estimator import Estimator

    names = vision_names(model)
    if not vision.offload_weights:
        chosen = {n: GPU_RESIDENT for n in names}
        idle = chosen
    else:
        est = Estimator(model, profile)
        chosen = {}
        for name in names:
            sublayer = model[name]
            cpu_s = est.compute_s(sublayer, "cpu", patches, 0) + est.launch_s(sublayer, "cpu", patches)
            gpu_s = max(est.copy_s(sublayer), est.compute_s(sublayer, "cuda", patches, 0)) \
                + est.launch_s(sublayer, "cuda", patches)
            chosen[name] = GPU_STREAMED if gpu_s < cpu_s else CPU
        idle = {n: CPU for n in names}

    def place(placement: Placement, vision_where: dict, name: str) -> Placement:
        where = placement.as_dict()
        where.update(vision_where)
        return Placement(name, tuple((s.name, where[s.name]) for s in model))

    tiers = list(base.tiers)
    placements = [place(p, idle, p.name) for p in base.placements]
    threads = list(base.threads)
    if tiers[-1] < LM_CAP:  # steps bigger than the largest tier keep its placement
        tiers.append(LM_CAP), placements.append(placements[-1]), threads.append(threads[-1])
    tiers.append(VISION_TIER)
    placements.append(place(base.placements[-1], chosen, "vision"))
    threads.append(None)
    return TieredPlacement(tuple(tiers), tuple(placements), tuple(threads))


def _vision_need(engine, plans: TieredPlacement, patches: int, vision: VisionOptions, num_slots: int) -> int:
    """VRAM of the larger phase (vision, or the language model's steps) under ``plans``."""
    executor = engine.executor
    slots, ctx = executor.kv_plan
    need = tiered_vram_need(engine.model, plans, slots, ctx, engine.max_step_tokens, num_slots)
    return max(need.total, _phase_bytes(engine.model, need, patches, vision, vision.memory_efficient_attention))


def _phase_bytes(model, need, patches: int, vision: VisionOptions, efficient: bool) -> int:
    """Peak VRAM of the vision phase: resident weights, slots, activations (and KV + LM workspace
    when the phases overlap)."""
    total = (need.resident + need.slots + need.experts
             + vision_workspace_bytes(model, patches, efficient, vision.mlp_rows))
    if not vision.free_before_prefill:
        total += need.kv + need.workspace
    return total


def _rebuild_executor(engine, plans: TieredPlacement) -> None:
    from .runtime.executor import Executor

    old = engine.executor
    slots, ctx = old.kv_plan
    kwargs = dict(budget=old.budget, max_tokens=engine.max_step_tokens, max_context=ctx, kv_slots=slots,
                  num_slots=len(old.ring.slots) if old.ring else (engine.plan.num_slots if engine.plan else 2),
                  threads=old.threads, device=old.gpu, simulate_gpu=old.simulated, decode_graphs=old.decode_graphs,
                  decode_compile=old.decode_compile, expert_cpu_share=old.expert_cpu_share)
    host, old_plans = old.host, old.plans
    engine.executor = None
    del old  # its VRAM goes back before the new placement loads
    gc.collect()
    torch.cuda.empty_cache()
    try:
        executor = Executor(engine.model, host, plans, **kwargs)
    except VramshardError:  # e.g. the placement does not fit as the executor counts: keep the one it had
        _install(engine, Executor(engine.model, host, old_plans, **kwargs))
        raise
    _install(engine, executor)


def _install(engine, executor) -> None:
    executor.oom_handler = engine.budget.recover_from_oom  # as the engine set it on the one replaced
    engine.executor = executor


def check_vision_budget(engine, patches: int, memory_efficient: bool) -> None:
    """Raise BudgetError when ``patches`` patches need more VRAM than the engine's budget allows."""
    executor = engine.executor
    if executor.budget is None:
        return
    vision = vision_setup(engine).options
    check_fits(engine.model, executor.need, executor.budget, patches, replace(
        vision, memory_efficient_attention=memory_efficient))


def check_fits(model, need, budget: int, patches: int, vision: VisionOptions) -> None:
    """Raise BudgetError, with the VRAM needed and the most pixels that fit, when the vision phase of
    ``patches`` patches does not fit ``budget`` beside ``need`` (a :class:`VramNeed`)."""
    efficient = vision.memory_efficient_attention
    needed = _phase_bytes(model, need, patches, vision, efficient)
    if needed <= budget:
        return
    low, high = 0, patches  # the most patches that fit: binary search (the need grows with patches)
    while low < high:
        middle = (low + high + 1) // 2
        if _phase_bytes(model, need, middle, vision, efficient) <= budget:
            low = middle
        else:
            high = middle - 1
    smallest = model.args.vision.spatial_merge_size ** 2  # one merged token: the smallest image there is
    if low < smallest:
        floor = _phase_bytes(model, need, smallest, vision, efficient)
        raise BudgetError(
            f"no image fits the vision phase under the budget of {format_bytes(budget)} with this placement and "
            f"these vision options: even the smallest image needs {format_bytes(floor)} (the image(s) given need "
            f"{format_bytes(needed)}); raise --vram to at least {format_bytes(needed)}"
            + ("" if efficient and vision.free_before_prefill else
               ", or turn the memory-efficient attention and free-before-prefill options on"))
    pixels = low * model.args.vision.patch_size ** 2
    side = int(pixels ** 0.5)
    raise BudgetError(
        f"the image(s) ({patches} patches, about {patches * model.args.vision.patch_size ** 2:,} pixels) need "
        f"{format_bytes(needed)} of VRAM for the vision phase, more than the budget of {format_bytes(budget)}; "
        f"at most {pixels:,} pixels (about {side}x{side}) fit: pass smaller images or a max_pixels of at most "
        f"{pixels} to the image preprocessing, or raise --vram to at least {format_bytes(needed)}"
        + ("" if efficient and vision.free_before_prefill else
           " (turning the memory-efficient attention and free-before-prefill options on needs less)"))


def vision_names(model) -> list[str]:
    """The vision sub-layers of ``model``, in run order (empty for a text-only model)."""
    return [s.name for s in model if s.kind == "vision"]


def check_image_inputs(engine, pixel_values, image_grid_thw) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """Validate the processor tensors: pixel_values [N, C*T*P*P] float, image_grid_thw [images, 3]."""
    if not vision_names(engine.model):
        raise InvalidInputError(f"{engine.model_name} has no vision encoder; pixel_values need a "
                                "vision-language model such as Qwen2.5-VL")
    if image_grid_thw is None:
        raise InvalidInputError("pixel_values need image_grid_thw (the [images, 3] grid tensor the image processor "
                                "returns with them)")
    pixels = torch.as_tensor(pixel_values)
    grid = torch.as_tensor(image_grid_thw).reshape(-1, 3).tolist()
    vision = engine.args.vision
    if pixels.dim() != 2 or pixels.shape[1] != vision.patch_dim:
        raise InvalidInputError(f"pixel_values must have shape [patches, {vision.patch_dim}], got {list(pixels.shape)}")
    patches = sum(t * h * w for t, h, w in grid)
    if patches != pixels.shape[0]:
        raise InvalidInputError(f"image_grid_thw describes {patches} patches but pixel_values has {pixels.shape[0]}")
    if engine.executor.uses_gpu:  # before the prompt's length: the clearer error for a huge image
        check_vision_budget(engine, patches, vision_setup(engine).options.memory_efficient_attention)
    return pixels, [tuple(int(v) for v in g) for g in grid]


def encode_images(engine, pixel_values: torch.Tensor, grid: list[tuple[int, int, int]],
                  tile_queries: bool | None = None) -> torch.Tensor:
    """Run the vision sub-layers: image embeddings [sum(t*h*w) / merge^2, hidden] on the CPU.

    Follows the engine's :class:`VisionOptions` (``tile_queries`` overrides its attention switch).
    Raises BudgetError when the images need more VRAM than the budget leaves the vision phase.
    """
    setup = vision_setup(engine)
    options = setup.options
    efficient = options.memory_efficient_attention if tile_queries is None else tile_queries
    step = VisionStep(grid, engine.args.vision, tile_queries=efficient,
                      mlp_rows=options.mlp_rows if efficient else None)
    executor = engine.executor
    if executor.uses_gpu:
        check_vision_budget(engine, step.num_patches, efficient)
    with _attention_kernels(efficient):
        embeds = executor.run_sublayers(vision_names(engine.model), pixel_values, step,
                                        VISION_TIER if setup.vision_tier else None)
    if executor.uses_gpu and options.free_before_prefill:
        # The vision activations are garbage now; hand their blocks back so the language
        # model's KV cache and workspace start from the resident weights alone.
        torch.cuda.empty_cache()
    return embeds


@contextlib.contextmanager
def _attention_kernels(memory_efficient: bool):
    """Off: force the math SDPA kernel, which materializes the scores (the baseline to measure against)."""
    if memory_efficient:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        yield


def tokens_per_image(grid: list[tuple[int, int, int]], merge: int) -> list[int]:
    return [t * h * w // (merge * merge) for t, h, w in grid]


def assign_images(prompts: list[list[int]], grid: list[tuple[int, int, int]], args) -> list[list[int]]:
    """Which images (indices into ``grid``) each prompt holds, in order; checks placeholder counts."""
    counts = tokens_per_image(grid, args.vision.spatial_merge_size)
    out, image = [], 0
    for index, ids in enumerate(prompts):
        mine, pads = [], sum(1 for t in ids if t == args.image_token_id)
        while pads > 0 and image < len(counts):
            mine.append(image)
            pads -= counts[image]
            image += 1
        if pads != 0:
            raise InvalidInputError(
                f"prompt {index} has image placeholder tokens that do not match its images' sizes "
                f"({counts} tokens per image); expand each <|image_pad|> to the image's token count "
                "(vramshard.loading.image.expand_image_tokens)")
        out.append(mine)
    if image != len(counts):
        raise InvalidInputError(f"{len(counts)} images given but the prompts have placeholders for {image}")
    return out


def rope_index(ids: list[int], grid: list[tuple[int, int, int]], args) -> tuple[torch.Tensor, int]:
    """Multimodal rotary positions [3, T] of one prompt and its delta (next position - T).

    Text tokens count up on all three rows; the tokens of an image take (t, row, column)
    positions offset by the position where the image starts; the text after it resumes
    at that start plus the image's larger side (in merge groups).
    """
    merge = args.vision.spatial_merge_size
    pieces, current, i, images = [], 0, 0, iter(grid)
    while i < len(ids):
        if ids[i] != args.image_token_id:
            j = i
            while j < len(ids) and ids[j] != args.image_token_id:
                j += 1
            pieces.append(torch.arange(j - i).expand(3, -1) + current)
            current += j - i
            i = j
            continue
        t, h, w = next(images)
        gh, gw = h // merge, w // merge
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
        pieces.append(torch.stack([tt, hh, ww]).reshape(3, -1) + current)
        current += max(gh, gw)
        i += t * gh * gw
    positions = torch.cat(pieces, dim=1)  # [3, T]
    return positions, int(positions.max()) + 1 - len(ids)


def prefill(engine, ids: list[int], positions: torch.Tensor, embeds: torch.Tensor | None, kv: KVCache,
            slot: int = 0, all_logits: bool = False) -> torch.Tensor:
    """Prefill one prompt in steps of at most ``max_step_tokens``; logits of all rows or of the last."""
    image_rows = torch.tensor([r for r, t in enumerate(ids) if t == engine.args.image_token_id], dtype=torch.long)
    size = engine.max_step_tokens
    if all_logits and engine.executor.uses_gpu:
        size = min(size, LOGIT_ROWS)  # the GPU workspace holds logits of at most LOGIT_ROWS rows
    rows = []
    for begin in range(0, len(ids), size):
        n = min(size, len(ids) - begin)
        inside = (image_rows >= begin) & (image_rows < begin + n)
        replace = None
        if embeds is not None and bool(inside.any()):
            replace = (image_rows[inside] - begin, embeds[inside.nonzero().flatten()])
        step = Step.single(begin, n, slot=slot, all_logits=all_logits, kv_lookup=kv,
                           rope_positions=positions[:, begin : begin + n], input_embeds=replace)
        rows.append(engine.executor.forward(torch.tensor(ids[begin : begin + n]), step))
    return torch.cat(rows) if all_logits else rows[-1][-1]


def logits(engine, ids, pixel_values, image_grid_thw, tile_queries: bool | None = None) -> torch.Tensor:
    """Float32 logits [len(ids), vocab] of one multimodal prompt (see :meth:`Engine.logits`)."""
    pixels, grid = check_image_inputs(engine, pixel_values, image_grid_thw)
    ids = engine._check_prompt(ids)
    assign_images([ids], grid, engine.args)
    overlap = not vision_setup(engine).options.free_before_prefill
    kv = engine.executor.new_kv_cache(slots=1, max_ctx=len(ids)) if overlap else None
    embeds = encode_images(engine, pixels, grid, tile_queries)
    positions, _ = rope_index(ids, grid, engine.args)
    if kv is None:
        kv = engine.executor.new_kv_cache(slots=1, max_ctx=len(ids))
    return prefill(engine, ids, positions, embeds, kv, all_logits=True)


def generate(engine, prompts: Sequence[Sequence[int]], pixel_values, image_grid_thw, max_new_tokens: int,
             params: list[SamplingParams], stop: Sequence[str] | None = None) -> list[list[int]]:
    """Generate for prompts with images (see :meth:`Engine.generate`); images are assigned to the
    prompts in order of their placeholders, as the Hugging Face processor does for a batch."""
    outputs: list[list[int]] = [[] for _ in prompts]
    for seq, token in run(engine, prompts, pixel_values, image_grid_thw, max_new_tokens, params, stop):
        outputs[seq].append(token)
    if stop:
        outputs = [engine._cut_at_stop(out, stop) for out in outputs]
    return outputs


def encode_prompts(engine, prompts: list[list[int]], pixels, grid: list[tuple[int, int, int]],
                   owners: list[list[int]]) -> list[MultimodalInput]:
    """The vision phase of ``prompts`` (checked, their images assigned by :func:`assign_images`):
    per prompt, its multimodal rotary positions and its images' features for the placeholder rows,
    as :meth:`Scheduler.add <vramshard.runtime.scheduler.Scheduler.add>` takes them."""
    embeds = encode_images(engine, pixels, grid) if grid else None
    per_image = torch.split(embeds, tokens_per_image(grid, engine.args.vision.spatial_merge_size)) if grid else ()
    inputs = []
    for ids, mine in zip(prompts, owners):
        positions, delta = rope_index(ids, [grid[i] for i in mine], engine.args)
        rows = torch.tensor([r for r, t in enumerate(ids) if t == engine.args.image_token_id], dtype=torch.long)
        features = torch.cat([per_image[i] for i in mine]) if mine else None
        inputs.append(MultimodalInput(positions, delta, rows, features))
    return inputs


def run(engine, prompts: Sequence[Sequence[int]], pixel_values, image_grid_thw, max_new_tokens: int,
        params: list[SamplingParams], stop: Sequence[str] | None = None) -> Iterator[tuple[int, int]]:
    """Yield (prompt index, new token) as they are made: vision phase, multimodal prefill, decode.

    ``engine.last_stats.extra`` gets ``vision_s`` (seconds of the vision phase) and, on the GPU,
    ``vision_peak_vram`` (peak VRAM bytes up to the end of the vision phase, beyond what the process
    held before the executor was built) and ``vision_peak_reserved`` (``torch.cuda.max_memory_reserved``
    then: the same peak as torch counts it since its last ``reset_peak_memory_stats``).
    """
    if max_new_tokens < 0:
        raise InvalidInputError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if stop and engine.tokenizer is None:
        raise InvalidInputError("stop strings need a tokenizer, and this model has none")
    pixels, grid = check_image_inputs(engine, pixel_values, image_grid_thw)
    prompts = [engine._check_prompt(p) for p in prompts]
    owners = assign_images(prompts, grid, engine.args)
    if not prompts or max_new_tokens == 0:
        return
    longest = max(len(p) for p in prompts) + max_new_tokens
    if longest > engine.max_context:
        raise InvalidInputError(f"prompt plus max_new_tokens is {longest} tokens, more than the context of "
                                f"{engine.max_context}")
    executor = engine.executor
    overlap = not vision_setup(engine).options.free_before_prefill
    # Without the "free before prefill" optimization the KV pool is allocated first, as a naive
    # implementation would: the two phases' VRAM then adds up.
    scheduler = engine._scheduler_for(prompts, max_new_tokens) if overlap else None
    t0 = time.perf_counter()
    multimodal = encode_prompts(engine, prompts, pixels, grid, owners)
    extra = {"vision_s": time.perf_counter() - t0}
    if executor.uses_gpu:
        extra["vision_peak_vram"] = executor.peak_vram()
        extra["vision_peak_reserved"] = torch.cuda.max_memory_reserved(executor.gpu)
    # Prefill and decode through the continuous-batching scheduler, as text prompts.
    yield from engine._run(prompts, max_new_tokens, params, stop, multimodal=multimodal, scheduler=scheduler,
                           extra=extra)


# ---------------------------------------------------------------------- chat with images
@dataclass
class ChatPrompt:
    """A chat rendered for the model: ids with expanded image placeholders, and the images' tensors."""

    ids: list[int]
    pixel_values: torch.Tensor | None = None  # float32 [patches, C*T*P*P]
    image_grid_thw: torch.Tensor | None = None  # int64 [images, 3]


def chat_prompt(engine, messages: str | Sequence[dict], images: Sequence[ImageSource] = (),
                add_generation_prompt: bool = True) -> ChatPrompt:
    """Render ``messages`` through the chat template, preprocess their images, expand the placeholders.

    messages: a string (one user message: the images, then the text) or OpenAI-style messages whose
    ``content`` is a string or a list of parts: ``{"type": "text", "text": ...}``,
    ``{"type": "image", "image": PIL image | path | bytes}`` or
    ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..." | path}}``. Image parts
    without an image of their own take the next of ``images``.
    """
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise InvalidInputError(f"{engine.model_name} has no tokenizer files, so a chat cannot be encoded; "
                                "use engine.generate with token ids, pixel_values and image_grid_thw")
    if isinstance(messages, str):
        messages = [{"role": "user", "content": [{"type": "image"} for _ in images]
                     + [{"type": "text", "text": messages}]}]
    spare = list(images)
    sources, rendered = [], []
    for message in messages:
        if not isinstance(message, dict) or "role" not in message:
            raise InvalidInputError(f"a chat message must be a dict with 'role' and 'content', got {message!r:.80}")
        content = message.get("content")
        if isinstance(content, (list, tuple)):
            content = "".join(_render_part(part, sources, spare) for part in content)
        rendered.append({**message, "content": content or ""})
    if spare:
        raise InvalidInputError(f"{len(spare)} image(s) given but the messages have no image part for them")
    if tokenizer.chat_template:
        ids = tokenizer.encode_chat(rendered, add_generation_prompt=add_generation_prompt)
    else:
        ids = tokenizer.encode("".join(m["content"] for m in rendered))
    if not sources:
        return ChatPrompt(ids)
    pad = tokenizer.backend.token_to_id(IMAGE_PAD)
    if pad != engine.args.image_token_id:
        raise InvalidInputError(f"the tokenizer's {IMAGE_PAD} token is {pad}, but the model's image_token_id is "
                                f"{engine.args.image_token_id}; use the tokenizer files that came with the model")
    if not vision_names(engine.model):
        raise InvalidInputError(f"{engine.model_name} is a text model; images need a vision-language model "
                                "such as Qwen2.5-VL")
    inputs = preprocess_images(sources, vision_setup(engine).image_config)
    ids = expand_image_tokens(ids, pad, inputs.tokens_per_image(engine.args.vision.spatial_merge_size))
    return ChatPrompt(ids, inputs.pixel_values, inputs.image_grid_thw)


def _render_part(part, sources: list, spare: list) -> str:
    """One content part as prompt text; an image part adds its source to ``sources``."""
    if isinstance(part, str):
        return part
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text":
        return str(part.get("text") or "")
    if kind in ("image", "image_url"):
        source = part.get("image")
        if kind == "image_url":
            url = part.get("image_url")
            source = url.get("url") if isinstance(url, dict) else url
        if source is None:
            if not spare:
                raise InvalidInputError("a message has more image parts than images were given")
            source = spare.pop(0)
        elif isinstance(source, str) and source.startswith("data:"):
            from .loading.image import decode_data_url

            source = decode_data_url(source)
        sources.append(source)
        return IMAGE_PLACEHOLDER
    raise InvalidInputError(f"content part {part!r:.80} is not understood; use type 'text', 'image' or 'image_url'")


def generate_chat(engine, messages: str | Sequence[dict], images: Sequence[ImageSource] = (),
                  max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                  seed: int | None = None, stop: Sequence[str] | None = None, **adjust) -> list[int]:
    """The new token ids of the answer to ``messages`` (see :func:`chat_prompt`), images included.
    ``adjust``: penalties and logit bias, as :meth:`Engine.generate`."""
    prompt = chat_prompt(engine, messages, images)
    if prompt.pixel_values is None:
        return engine.generate([prompt.ids], max_new_tokens, temperature, top_k, top_p, seed, stop, **adjust)[0]
    return generate(engine, [prompt.ids], prompt.pixel_values, prompt.image_grid_thw, max_new_tokens,
                    [SamplingParams(temperature, top_k, top_p, seed, **adjust)], stop)[0]


def stream_chat(engine, messages: str | Sequence[dict], images: Sequence[ImageSource] = (),
                max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                seed: int | None = None, **adjust) -> Iterator[int]:
    """Yield the new token ids of the answer to ``messages`` as they are made."""
    prompt = chat_prompt(engine, messages, images)
    yield from stream_prompt(engine, prompt, max_new_tokens, temperature, top_k, top_p, seed, **adjust)


def stream_prompt(engine, prompt: ChatPrompt, max_new_tokens: int = 128, temperature: float = 0.0,
                  top_k: int = 0, top_p: float = 1.0, seed: int | None = None, **adjust) -> Iterator[int]:
    """Yield the new tokens of a rendered :class:`ChatPrompt`."""
    if prompt.pixel_values is None:
        yield from engine.stream(prompt.ids, max_new_tokens, temperature, top_k, top_p, seed, **adjust)
        return
    for _, token in run(engine, [prompt.ids], prompt.pixel_values, prompt.image_grid_thw, max_new_tokens,
                        [SamplingParams(temperature, top_k, top_p, seed, **adjust)]):
        yield token
