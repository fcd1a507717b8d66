"""``vramshard plan MODEL --vram 4GiB``: show the plan the engine would run."""

from __future__ import annotations

import argparse
import json

from .common import add_threads_arg


def register(subparsers) -> None:
    p = subparsers.add_parser("plan", help="show where every sub-layer would run, per token tier")
    p.add_argument("model", nargs="?", help="Hugging Face model directory or .gguf file")
    p.add_argument("--shape", help="plan a named real shape instead of a file (e.g. nemo-8b, llama3-8b, qwen3-30b-a3b)")
    p.add_argument("--vram", required=True, help="VRAM budget, e.g. 4GiB or 2048MiB, or auto (free VRAM less a margin)")
    p.add_argument("--ctx", type=int, default=4096, help="context tokens to reserve KV cache for (default 4096)")
    p.add_argument("--tiers", default=None, help="token tiers, e.g. 1,4,16,64,256,512,1024,2048")
    p.add_argument("--slots", type=int, default=2, help="streaming slots in the ring (default 2)")
    p.add_argument("--profile", default=None, help="profile file (default: this machine's)")
    p.add_argument("--dtype", default=None, help="weights dtype (default: the checkpoint's)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="price decode steps as an engine with CUDA graphs runs them: runs of resident sub-layers "
                        "replayed (default: on, where the profile has a GPU; --no-cuda-graphs: every launch eager)")
    add_threads_arg(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="draw where each sub-layer runs per tier")
    p.set_defaults(func=main)


def main(args) -> int:
    from ..config import parse_dtype
    from ..errors import InvalidInputError
    from ..models import build_model
    from ..plan.mechanisms import pricing_graphs
    from ..plan.planner import Planner, machine_profile
    from ..plan.report import plot_plan, print_plan
    from ..plan.tiers import Tiers
    from ..engine import planning_profile, resolve_budget
    from ..units import is_auto, parse_size

    if bool(args.model) == bool(args.shape):
        raise InvalidInputError("give a MODEL path or --shape NAME (one of them)")
    if args.shape:
        from ..shapes import shape_config

        config, name = shape_config(args.shape), args.shape
    else:
        from ..loading.checkpoint import open_checkpoint

        checkpoint = open_checkpoint(args.model)
        config, name = checkpoint.config, checkpoint.path.name
    model = build_model(config, parse_dtype(args.dtype))
    tiers = Tiers.parse(args.tiers) if args.tiers else Tiers()
    # auto: this machine's free VRAM (None without CUDA, where the plan is all-CPU anyway).
    budget = resolve_budget(args.vram, None)[0] if is_auto(args.vram) else parse_size(args.vram)
    # As an engine would plan: the host's read bandwidth now, the factors engines fitted here.
    profile = planning_profile(machine_profile(args.profile), model.dtype).limited_to(args.threads)
    # As an engine on the profile's machine would price its decode steps (its graphs on by default).
    graphs = args.cuda_graphs and profile.has_gpu
    with pricing_graphs(graphs):
        plan = Planner(model, profile, budget, context=args.ctx, tiers=tiers,
                       num_slots=args.slots, name=name).plan()
    if profile.has_gpu:
        plan.notes.append("decode tiers priced with runs of resident sub-layers replayed from CUDA graphs, as an "
                          "engine runs them (--no-cuda-graphs: every launch eager)" if graphs else
                          "decode tiers priced with every launch eager (--no-cuda-graphs)")
    if profile.cpu_scale != 1.0:
        plan.notes.append(f"profile's CPU times x{profile.cpu_scale:.2f}: the host reads memory "
                          f"{'faster' if profile.cpu_scale < 1 else 'slower'} now than when profiled "
                          "(VRAMSHARD_DRIFT_CHECK=off: as measured)")
    if profile.compute_rows:
        rows = ", ".join(f"x{f:.2f} at {m}" for m, f in profile.compute_rows)
        plan.notes.append(f"profile's CPU compute by rows {rows}: the host's products now "
                          "(VRAMSHARD_COMPUTE_DRIFT=off: by the read alone)")
    coded = coded_fills_note(model, plan)
    if coded:
        plan.notes.append(coded)
    if profile.cpu_rows or profile.split_rows or profile.dispatch_scale != 1.0:
        plan.notes.append("with the factors engines fitted on this profile (`vramshard profile --show` lists them)")
    plan.notes.append(host_memory_note(model))
    if args.json:
        print(json.dumps(plan.to_dict(), indent=1))
    else:
        print_plan(plan)
    if args.plot:
        plot_plan(plan, args.plot)
    return 0


def coded_fills_note(model, plan) -> str | None:
    """What coding stream fills for the link (``VRAMSHARD_WIRE_CODEC``) does to this plan, where it streams
    a bf16 model's weights with the codec on; None otherwise."""
    from ..plan.mechanisms import wire_codec_enabled
    from ..runtime import wire_codec
    from ..units import format_bytes

    if wire_codec.wire_ratio(model.dtype, wire_codec_enabled()) == 1.0 or not plan.need.slots:
        return None
    from ..plan.memory import sublayer_packed_bytes

    # The attention and FFNs not pinned raw: those streamed and those pinned coded (loaded from their coded copies).
    raw_pins = set(plan.pinned) - set(plan.coded_names)
    most = wire_codec.coded_bytes(sum(sublayer_packed_bytes(model, s.name) for s in model
                                      if s.kind in ("attn", "ffn") and s.name not in raw_pins))
    return (f"stream fills coded for PCIe (VRAMSHARD_WIRE_CODEC): priced at x{wire_codec.RATIO:.3f} of their bytes, "
            f"{format_bytes(wire_codec.STAGING_BYTES)} of staging in the slots; their coded copies (and those of the "
            f"pins kept coded) take up to "
            f"{format_bytes(most)} more of pinned host memory (none where that is over "
            f"{round(100 * wire_codec.HOST_SHARE)}% of what is available at load: then the fills stay raw)")


def host_memory_note(model) -> str:
    """What loading ``model`` takes of the host's memory, against what is available now."""
    from ..engine import host_bytes_to_load
    from ..host_memory import meminfo_bytes
    from ..units import format_bytes

    need, available = host_bytes_to_load(model), meminfo_bytes("MemAvailable")
    note = f"host memory: loading takes {format_bytes(need)} (the weights' pinned copy {format_bytes(model.nbytes)})"
    if available is None:
        return note
    return note + f"; {format_bytes(available)} available now" + (
        " — too little: loading would be refused" if need > available else "")
