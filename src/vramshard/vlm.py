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

import logging
import time
from typing import Sequence

import torch

from .errors import InvalidInputError
from .layers.step import Step
from .layers.vision import VisionStep
from .plan.memory import LOGIT_ROWS
from .runtime.kv_cache import KVCache
from .runtime.sampler import Sampler, SamplingParams

log = logging.getLogger(__name__)


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
    return pixels, [tuple(int(v) for v in g) for g in grid]


def encode_images(engine, pixel_values: torch.Tensor, grid: list[tuple[int, int, int]],
                  tile_queries: bool = True) -> torch.Tensor:
    """Run the vision sub-layers: image embeddings [sum(t*h*w) / merge^2, hidden] on the CPU."""
    step = VisionStep(grid, engine.args.vision, tile_queries=tile_queries)
    return engine.executor.run_sublayers(vision_names(engine.model), pixel_values, step)


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


def logits(engine, ids, pixel_values, image_grid_thw, tile_queries: bool = True) -> torch.Tensor:
    """Float32 logits [len(ids), vocab] of one multimodal prompt (see :meth:`Engine.logits`)."""
    ids = engine._check_prompt(ids)
    pixels, grid = check_image_inputs(engine, pixel_values, image_grid_thw)
    assign_images([ids], grid, engine.args)
    embeds = encode_images(engine, pixels, grid, tile_queries)
    positions, _ = rope_index(ids, grid, engine.args)
    kv = engine.executor.new_kv_cache(slots=1, max_ctx=len(ids))
    return prefill(engine, ids, positions, embeds, kv, all_logits=True)


def generate(engine, prompts: Sequence[Sequence[int]], pixel_values, image_grid_thw, max_new_tokens: int,
             params: list[SamplingParams], stop: Sequence[str] | None = None) -> list[list[int]]:
    """Generate for prompts with images (see :meth:`Engine.generate`); images are assigned to the
    prompts in order of their placeholders, as the Hugging Face processor does for a batch."""
    from .engine import GenerationStats

    if max_new_tokens < 0:
        raise InvalidInputError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if stop and engine.tokenizer is None:
        raise InvalidInputError("stop strings need a tokenizer, and this model has none")
    prompts = [engine._check_prompt(p) for p in prompts]
    pixels, grid = check_image_inputs(engine, pixel_values, image_grid_thw)
    owners = assign_images(prompts, grid, engine.args)
    longest = max(len(p) for p in prompts) + max_new_tokens
    if longest > engine.max_context:
        raise InvalidInputError(f"prompt plus max_new_tokens is {longest} tokens, more than the context of "
                                f"{engine.max_context}")
    outputs: list[list[int]] = [[] for _ in prompts]
    if max_new_tokens == 0 or not prompts:
        return outputs
    stats = engine.last_stats = GenerationStats(prompt_tokens=sum(len(p) for p in prompts))
    t0 = time.perf_counter()
    embeds = encode_images(engine, pixels, grid)
    stats.extra["vision_s"] = time.perf_counter() - t0
    per_image = torch.split(embeds, tokens_per_image(grid, engine.args.vision.spatial_merge_size))
    kv = engine.executor.new_kv_cache(slots=len(prompts), max_ctx=longest)
    last, deltas = [], []
    for slot, (ids, mine) in enumerate(zip(prompts, owners)):
        positions, delta = rope_index(ids, [grid[i] for i in mine], engine.args)
        mine_embeds = torch.cat([per_image[i] for i in mine]) if mine else None
        last.append(prefill(engine, ids, positions, mine_embeds, kv, slot=slot))
        deltas.append(delta)
        stats.steps += 1
    stats.prefill_s = time.perf_counter() - t0
    logits = torch.stack(last)

    samplers = [Sampler(p) for p in params]
    eos = engine._eos_ids()
    active, cached = list(range(len(prompts))), [len(p) for p in prompts]
    t0 = time.perf_counter()
    while True:
        next_tokens = {}
        for row, seq in enumerate(active):
            token = samplers[seq](logits[row])
            outputs[seq].append(token)
            stats.generated_tokens += 1
            if not (token in eos or len(outputs[seq]) >= max_new_tokens
                    or (stop and engine._cut_at_stop(outputs[seq], stop) != outputs[seq])):
                next_tokens[seq] = token
        active = list(next_tokens)
        if not active:
            break
        rows = []
        for begin in range(0, len(active), engine.max_step_tokens):
            group = active[begin : begin + engine.max_step_tokens]
            # After the prompt, all three rotary rows are equal: 1-D positions shifted by the delta.
            rope = torch.tensor([cached[s] + deltas[s] for s in group], dtype=torch.long)
            step = Step(group, [cached[s] for s in group], [1] * len(group), list(range(len(group))),
                        kv_lookup=kv, rope_positions=rope)
            rows.append(engine.executor.forward(torch.tensor([next_tokens[s] for s in group]), step))
            stats.steps += 1
        logits = torch.cat(rows)
        for s in active:
            cached[s] += 1
    stats.decode_s = time.perf_counter() - t0
    if stop:
        outputs = [engine._cut_at_stop(out, stop) for out in outputs]
    return outputs
