"""Where the VRAM of one image chat goes: peak allocated and reserved bytes per phase, and the
live allocations at the peak grouped by the vramshard line that made them.

    PYTHONPATH=src python -m benchmarks.vlm_memory [--budget 2] [--image 1440p] [--decode 4] [--json-name NAME]

Builds the Qwen2.5-VL-7B shape of ``vlm_bench`` (random weights) under ``--budget`` GiB with all
vision optimizations on, records the CUDA caching allocator's history
(``torch.cuda.memory._record_memory_history``) over one image chat, and replays it: the peak of
live allocations, what was live then, and the reserved segments' peak. Writes
``$OUT/vlm_memory.json``.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import time

import torch

from benchmarks.common import hardware, now, out_dir, write_json
from benchmarks.vlm_bench import CONTEXT, IMAGE_CONFIG, RESOLUTIONS, SHAPE, STEP_TOKENS, image_inputs
from vramshard import vlm
from vramshard.engine import Engine
from vramshard.shapes import random_weights, shape_model

log = logging.getLogger("vlm_memory")


def origin(frames: list[dict]) -> str:
    """The innermost vramshard frame of an allocation's Python stack (file:line function)."""
    for frame in frames:
        name = frame.get("filename", "")
        if "vramshard" in name and "/torch/" not in name:
            return f"{name.split('vramshard/')[-1]}:{frame.get('line')} {frame.get('name')}"
    return "outside vramshard"


def replay(trace: list[dict]) -> dict:
    """Peak of live allocated bytes over the trace, and what was live at that moment."""
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    segments = reserved_peak = 0
    for event in trace:
        action, addr, size = event["action"], event["addr"], event["size"]
        if action == "alloc":
            live[addr] = (size, origin(event.get("frames", [])))
            total += size
            if total > peak:
                peak, at_peak = total, dict(live)
        elif action == "free_completed" and addr in live:
            total -= live.pop(addr)[0]
        elif action in ("segment_alloc", "segment_map"):
            segments += size
            reserved_peak = max(reserved_peak, segments)
        elif action in ("segment_free", "segment_unmap"):
            segments -= size
    groups: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for size, where in at_peak.values():
        groups[where][0] += size
        groups[where][1] += 1
    top = sorted(groups.items(), key=lambda kv: -kv[1][0])[:25]
    return {"peak_allocated": peak, "segments_peak_in_trace": reserved_peak,
            "live_at_peak": [{"where": where, "bytes": b, "count": c} for where, (b, c) in top]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=int, default=2, choices=sorted(STEP_TOKENS))
    parser.add_argument("--image", default="1440p", choices=sorted(RESOLUTIONS))
    parser.add_argument("--decode", type=int, default=4)
    parser.add_argument("--json-name", default="vlm_memory.json", help="file name under $OUT")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    model = shape_model(SHAPE)
    base = torch.cuda.memory_reserved()
    engine = Engine.from_weights(model, random_weights(model), name=SHAPE, vram=f"{args.budget}GiB", device="cuda",
                                 max_context=CONTEXT, max_step_tokens=STEP_TOKENS[args.budget])
    options = vlm.VisionOptions(plan_pixels=RESOLUTIONS[args.image][0] * RESOLUTIONS[args.image][1])
    vlm.configure(engine, options, IMAGE_CONFIG)
    ids, inputs = image_inputs(args.image)
    prompt = vlm.ChatPrompt(ids, inputs.pixel_values, inputs.image_grid_thw)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    loaded = {"allocated": torch.cuda.memory_allocated() - base, "reserved": torch.cuda.memory_reserved() - base}
    phases = []

    def mark(name: str) -> None:
        torch.cuda.synchronize()
        phases.append({"phase": name, "time": time.perf_counter(),
                       "peak_allocated": torch.cuda.max_memory_allocated() - base,
                       "peak_reserved": torch.cuda.max_memory_reserved() - base,
                       "allocated": torch.cuda.memory_allocated() - base,
                       "reserved": torch.cuda.memory_reserved() - base})
        torch.cuda.reset_peak_memory_stats()

    torch.cuda.memory._record_memory_history(max_entries=400_000, stacks="python")
    tokens = 0
    for _ in vlm.stream_prompt(engine, prompt, max_new_tokens=args.decode):
        tokens += 1
        mark("vision + prefill" if tokens == 1 else f"decode {tokens}")
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    report = {
        "date": now(), "hardware": hardware(), "shape": SHAPE, "budget_gib": args.budget, "image": args.image,
        "prompt_tokens": len(ids), "plan": engine.executor.plans.name,
        "chunk_attention": os.environ.get("VRAMSHARD_CHUNK_ATTENTION", "lower_right"),
        "planned": engine.executor.need.breakdown(), "loaded": loaded, "phases": phases,
        "extra": {k: v for k, v in engine.last_stats.extra.items() if isinstance(v, (int, float))},
        "trace_events": len(trace), "replay": replay(trace),
    }
    path = out_dir() / args.json_name
    write_json(path, report)
    log.info("loaded %s; phases %s", loaded, [(p["phase"], p["peak_reserved"]) for p in phases])
    for row in report["replay"]["live_at_peak"][:15]:
        log.info("at peak: %8.1f MiB x%d  %s", row["bytes"] / 2**20, row["count"], row["where"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
