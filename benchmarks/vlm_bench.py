"""VLM benchmark: Qwen2.5-VL-7B shapes (random weights) with one image at 480p … 1440p under 2, 4, 8 GiB.

    PYTHONPATH=src python -m benchmarks.vlm_bench [--quick] [--deadline 510]

For each budget and each set of vision options (all three VRAM optimizations on, each one
off, all off) one image per resolution goes through ``vramshard.vlm``: peak VRAM
(``max_memory_reserved`` over the run, less what was reserved before the engine was built),
peak VRAM of the vision phase, vision time, TTFT and end-to-end latency of a 128-token
answer. The answer is decoded in full for the all-on options at 720p; elsewhere
``--decode`` tokens are decoded and the 128-token latency is TTFT + 127 x the measured
per-token time (``e2e_measured`` says which). Budget refusals (the engine's clear error)
and CUDA OOMs are recorded, not fatal.

External baseline in the same run: Hugging Face transformers, the model built from its config
with random bf16 weights (no download), ``device_map="auto"`` with ``max_memory`` at the same
budget (Accelerate puts what does not fit on the CPU and moves it per forward).

Writes ``$OUT/vlm_bench.json``. Runs still queued at ``--deadline`` seconds are recorded as
skipped, so one call stays within the machine's 10 minutes.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import time

import numpy as np
import torch

from benchmarks.common import hardware, now, out_dir, write_json
from vramshard import vlm
from vramshard.engine import Engine
from vramshard.errors import BudgetError, VramshardError
from vramshard.loading.image import ImageConfig, expand_image_tokens, preprocess_images
from vramshard.shapes import random_weights, shape_config, shape_model

SHAPE = "qwen2.5-vl-7b"
RESOLUTIONS = {"480p": (854, 480), "720p": (1280, 720), "1080p": (1920, 1080), "1440p": (2560, 1440)}
BUDGETS_GIB = (2, 4, 8)
# Prompt chunk per budget: the workspace grows with it (in the flash kernel only with the activations;
# the sixth GPU session, which counted math-kernel scores, ran 256 / 1024 / 2048).
STEP_TOKENS = {2: 1024, 4: 2048, 8: 2048}
ANSWER = 128
CONTEXT = 5120  # a 1440p image is 4641 tokens
OPTION_SETS = {
    "all_on": vlm.VisionOptions(),
    "no_offload": vlm.VisionOptions(offload_weights=False),
    "no_efficient_attention": vlm.VisionOptions(memory_efficient_attention=False),
    "no_free_before_prefill": vlm.VisionOptions(free_before_prefill=False),
    "all_off": vlm.VisionOptions.all_off(),
}
IMAGE_CONFIG = ImageConfig(max_pixels=2560 * 1440)  # let 1440p through unscaled
TEXT_IDS = [151644, 872, 198]  # <|im_start|>user\n
TAIL_IDS = [74785, 279, 2168, 13, 151645, 198, 151644, 77091, 198]  # "Describe the image."<|im_end|> ... assistant\n

log = logging.getLogger("vlm_bench")


class Clock:
    def __init__(self, deadline_s: float):
        self.start = time.perf_counter()
        self.deadline_s = deadline_s

    def left(self) -> float:
        return self.deadline_s - (time.perf_counter() - self.start)


def image_inputs(name: str):
    width, height = RESOLUTIONS[name]
    rng = np.random.default_rng(0)
    from PIL import Image

    picture = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")
    inputs = preprocess_images([picture], IMAGE_CONFIG)
    image_token = shape_config(SHAPE)["image_token_id"]
    ids = TEXT_IDS + [151652, image_token, 151653] + TAIL_IDS
    ids = expand_image_tokens(ids, image_token, inputs.tokens_per_image(2))
    return ids, inputs


def reset_peak():
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()


def ours_one(engine, base_reserved: int, ids, inputs, decode: int) -> dict:
    """One image through vramshard: TTFT, vision time, per-token decode time, peaks."""
    reset_peak()
    prompt = vlm.ChatPrompt(ids, inputs.pixel_values, inputs.image_grid_thw)
    start = time.perf_counter()
    first = last = None
    count = 0
    for _ in vlm.stream_prompt(engine, prompt, max_new_tokens=decode):
        last = time.perf_counter()
        first = first or last
        count += 1
    stats = engine.last_stats
    ttft = first - start
    per_token = (last - first) / max(count - 1, 1)
    return {
        "status": "ok", "prompt_tokens": len(ids), "patches": int(inputs.pixel_values.shape[0]),
        "peak_vram": torch.cuda.max_memory_reserved() - base_reserved,
        # Both peaks over the same base: what was reserved before the engine was built.
        "vision_peak_vram": stats.extra["vision_peak_reserved"] - base_reserved if "vision_peak_reserved" in stats.extra
        else None,
        "vision_s": stats.extra.get("vision_s"), "ttft_s": ttft, "decode_tokens": count,
        "decode_s_per_token": per_token, "e2e_128_s": ttft + (ANSWER - 1) * per_token,
        "e2e_measured": count >= ANSWER,
    }


def run_ours(results: list, budgets, images, option_sets, decode: int, clock: Clock, profile=None) -> None:
    model = shape_model(SHAPE)
    for gib in budgets:
        if clock.left() < 30:
            results.append({"system": "vramshard", "budget_gib": gib, "status": "skipped (time)"})
            continue
        gc.collect()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_reserved()
        t0 = time.perf_counter()
        engine = Engine.from_weights(model, random_weights(model), name=SHAPE, vram=f"{gib}GiB", device="cuda",
                                     max_context=CONTEXT, max_step_tokens=STEP_TOKENS[gib], profile=profile)
        log.info("engine for %d GiB built in %.1f s", gib, time.perf_counter() - t0)
        for option_name, options in option_sets.items():
            row = {"system": "vramshard", "budget_gib": gib, "options": option_name}
            options = dataclasses.replace(options, plan_pixels=max(w * h for w, h in
                                                                   (RESOLUTIONS[n] for n in images)))
            try:
                vlm.configure(engine, options, IMAGE_CONFIG, profile)
            except VramshardError as exc:
                results.append({**row, "status": "refused at load", "error": str(exc)})
                continue
            row["plan"] = engine.executor.plans.name
            row["vision_plan"] = engine.executor.plans.placements[-1].summary()
            row["planned_vram"] = engine.executor.need.total
            for name in images:
                if clock.left() < 20:
                    results.append({**row, "image": name, "status": "skipped (time)"})
                    continue
                ids, inputs = images[name]
                full = option_name == "all_on" and name == "720p"
                try:
                    measured = ours_one(engine, base, ids, inputs, ANSWER if full else decode)
                except BudgetError as exc:
                    measured = {"status": "refused (budget)", "error": str(exc)}
                except torch.cuda.OutOfMemoryError as exc:
                    measured = {"status": "OOM", "error": str(exc).splitlines()[0],
                                "peak_vram": torch.cuda.max_memory_reserved() - base}
                results.append({**row, "image": name, **measured})
                log.info("%s", results[-1])
        del engine
        gc.collect()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------- Hugging Face baseline
def hf_config(**small):
    import transformers

    config = shape_config(SHAPE)
    vision = {**config.pop("vision_config"), "in_channels": 3}
    text_keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "vocab_size", "max_position_embeddings", "rms_norm_eps",
                 "tie_word_embeddings")
    text = {k: config[k] for k in text_keys}
    text["rope_parameters"] = {"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1000000.0}
    if small:
        text.update(vocab_size=16, num_hidden_layers=1)
        vision.update(depth=1, fullatt_block_indexes=[0])
    return transformers.Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=config["image_token_id"],
        video_token_id=config["video_token_id"], vision_start_token_id=config["vision_start_token_id"],
        vision_end_token_id=config["vision_end_token_id"])


def hf_model():
    """Qwen2.5-VL-7B from its config, random-looking bf16 weights on the CPU (no download).

    Built on the meta device and materialized empty (a real random init of 8B parameters takes
    minutes); matrices are filled with a repeated random block, vectors with ones, and the
    rotary buffers copied from a one-layer model of the same widths.
    """
    import transformers

    with torch.device("meta"):
        model = transformers.Qwen2_5_VLForConditionalGeneration(hf_config())
    model = model.to_empty(device="cpu").to(torch.bfloat16).eval()
    block = (torch.randn(2**22) * 0.02).to(torch.bfloat16)
    with torch.no_grad():
        for tensor in model.parameters():
            if tensor.dim() == 1:
                tensor.fill_(1.0)
            else:
                flat = tensor.view(-1)
                reps = -(-flat.numel() // block.numel())
                flat.copy_(block.repeat(reps)[: flat.numel()])
        reference = dict(transformers.Qwen2_5_VLForConditionalGeneration(hf_config(small=True)).named_buffers())
        for name, buffer in model.named_buffers():
            if name in reference and reference[name].shape == buffer.shape:
                buffer.copy_(reference[name].to(buffer.dtype))
    return model


def run_hf(results: list, budgets, images, decode: int, clock: Clock) -> None:
    try:
        from accelerate import dispatch_model, infer_auto_device_map
    except ImportError as exc:
        results.append({"system": "transformers", "status": f"skipped: {exc}"})
        return
    for gib in budgets:
        row = {"system": "transformers", "budget_gib": gib, "options": "device_map=auto, max_memory"}
        if clock.left() < 60:
            results.append({**row, "status": "skipped (time)"})
            continue
        t0 = time.perf_counter()
        model = hf_model()
        log.info("HF model built in %.1f s", time.perf_counter() - t0)
        reset_peak()
        try:
            device_map = infer_auto_device_map(model, max_memory={0: gib * 2**30, "cpu": 400 * 2**30},
                                               no_split_module_classes=model._no_split_modules,
                                               dtype=torch.bfloat16)
            model = dispatch_model(model, device_map=device_map)
            row["gpu_modules"] = sum(1 for v in device_map.values() if v == 0)
            row["cpu_modules"] = sum(1 for v in device_map.values() if v == "cpu")
        except Exception as exc:  # a baseline failure is a result, not a crash
            results.append({**row, "status": f"error: {type(exc).__name__}", "error": str(exc)[:500]})
            del model
            continue
        for name in images:
            if clock.left() < 30:
                results.append({**row, "image": name, "status": "skipped (time)"})
                continue
            ids, inputs = images[name]
            reset_peak()
            measured = {}
            try:
                measured = _hf_generate(model, ids, inputs, decode)
            except torch.cuda.OutOfMemoryError as exc:
                measured = {"status": "OOM", "error": str(exc).splitlines()[0],
                            "peak_vram": torch.cuda.max_memory_reserved()}
            except Exception as exc:
                measured = {"status": f"error: {type(exc).__name__}", "error": str(exc)[:500]}
            results.append({**row, "image": name, **measured})
            log.info("%s", results[-1])
            gc.collect()
            torch.cuda.empty_cache()
        del model
        gc.collect()
        torch.cuda.empty_cache()


def _hf_generate(model, ids, inputs, decode: int) -> dict:
    input_ids = torch.tensor([ids], device="cuda")
    image_token = model.config.image_token_id
    kwargs = dict(pixel_values=inputs.pixel_values.to("cuda", torch.bfloat16),
                  image_grid_thw=inputs.image_grid_thw.to("cuda"))
    try:  # transformers >= 5 wants the multimodal token types too
        import inspect

        if "mm_token_type_ids" in inspect.signature(model.forward).parameters:
            kwargs["mm_token_type_ids"] = (input_ids == image_token).int()
    except (TypeError, ValueError):
        pass
    times = []

    class Timer:  # a streamer: called with the prompt first, then with each new token
        def put(self, value):
            times.append(time.perf_counter())

        def end(self):
            pass

    start = time.perf_counter()
    with torch.no_grad():
        model.generate(input_ids=input_ids, max_new_tokens=decode, min_new_tokens=decode, do_sample=False,
                       streamer=Timer(), pad_token_id=0, **kwargs)
    token_times = times[1:]  # the first put() is the prompt
    ttft = token_times[0] - start
    per_token = (token_times[-1] - token_times[0]) / max(len(token_times) - 1, 1)
    return {"status": "ok", "prompt_tokens": len(ids), "peak_vram": torch.cuda.max_memory_reserved(),
            "ttft_s": ttft, "decode_tokens": len(token_times), "decode_s_per_token": per_token,
            "e2e_128_s": ttft + (ANSWER - 1) * per_token, "e2e_measured": len(token_times) >= ANSWER}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="480p and 1440p, 2 and 8 GiB, all on / all off")
    parser.add_argument("--decode", type=int, default=16, help="tokens decoded where the answer is extrapolated")
    parser.add_argument("--deadline", type=float, default=510.0, help="seconds after which runs are skipped")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--systems", default="ours,hf", help="which to run: ours (vramshard), hf (transformers)")
    parser.add_argument("--budgets", default=None, help="GiB, comma-separated (default 2,4,8)")
    parser.add_argument("--profile", default=None, help="machine profile for the planner (default: the stored one)")
    args = parser.parse_args()
    systems = set(args.systems.split(","))
    if args.no_hf:
        systems.discard("hf")
    if not systems <= {"ours", "hf"}:
        parser.error(f"--systems takes ours and/or hf, got {args.systems}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("vlm_bench needs a CUDA GPU")
    clock = Clock(args.deadline)
    budgets = (2, 8) if args.quick else BUDGETS_GIB
    if args.budgets:
        budgets = tuple(int(b) for b in args.budgets.split(","))
        if not set(budgets) <= set(STEP_TOKENS):
            parser.error(f"--budgets takes GiB among {sorted(STEP_TOKENS)}, got {args.budgets}")
    names = ("480p", "1440p") if args.quick else tuple(RESOLUTIONS)
    option_sets = {k: OPTION_SETS[k] for k in (("all_on", "all_off") if args.quick else OPTION_SETS)}
    images = {name: image_inputs(name) for name in names}
    results: list[dict] = []
    report = {"date": now(), "hardware": hardware(), "shape": SHAPE, "answer_tokens": ANSWER,
              "context": CONTEXT, "step_tokens": STEP_TOKENS, "results": results}
    path = out_dir() / "vlm_bench.json"
    try:
        if "ours" in systems:
            from vramshard.plan.planner import machine_profile

            profile = machine_profile(args.profile) if args.profile else None
            run_ours(results, budgets, images, option_sets, args.decode, clock, profile)
            write_json(path, report)
        if "hf" in systems:
            run_hf(results, budgets, images, min(args.decode, 4), clock)
    finally:
        report["elapsed_s"] = time.perf_counter() - clock.start
        write_json(path, report)
    log.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
