"""The benchmark report, in parts that each fit one GPU call, merged into docs/BENCHMARKS.md.

    python -m benchmarks.report --list
    python -m benchmarks.report --part dense-nemo-a --out $OUT          # on the GPU machine
    python -m benchmarks.report --merge runs/2026-12-01 runs/2026-12-02 --md docs/BENCHMARKS.md --charts docs/charts/

See benchmarks/README.md for the order of the GPU calls and benchmarks/report/parts.py for the split.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys

from vramshard.errors import VramshardError

from .parts import PARTS


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--part", choices=sorted(PARTS), help="run one part (needs CUDA); JSON to --out")
    what.add_argument("--merge", nargs="+", metavar="DIR", help="folders (or files) of part JSONs to merge")
    what.add_argument("--list", action="store_true", help="list the parts with their expected minutes")
    parser.add_argument("--out", default=None, help="folder for the part's JSON (default $OUT or bench_out)")
    parser.add_argument("--md", default="docs/BENCHMARKS.md", help="markdown file the merge rewrites (markers)")
    parser.add_argument("--charts", default="docs/charts", help="folder for the merged report's PNG charts")
    smoke = parser.add_argument_group("overrides (smoke tests, re-running a few cells)")
    smoke.add_argument("--budgets", type=_floats, default=None, help="GiB, comma-separated")
    smoke.add_argument("--contexts", type=_ints, default=None)
    smoke.add_argument("--batch-sizes", type=_ints, default=None)
    smoke.add_argument("--deadline-s", type=float, default=None, help="start no cell after this many seconds")
    smoke.add_argument("--shape", default=None, help="another shape than the part's, e.g. tiny-llama")
    smoke.add_argument("--layers", type=int, default=None, help="cut the model to N layers")
    smoke.add_argument("--chunk", type=int, default=None, help="prompt tokens per step (default 1024)")
    smoke.add_argument("--ttft-cap-s", type=float, default=None)
    smoke.add_argument("--images", default=None, help="VLM: resolutions, e.g. 480p,1440p")
    smoke.add_argument("--option-sets", default=None, help="VLM: e.g. all_on,all_off")
    smoke.add_argument("--profile", default=None, help="machine profile file for the planner")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    command = " ".join(["python -m benchmarks.report", *map(shlex.quote, sys.argv[1:] if argv is None else argv)])
    try:
        if args.list:
            for part in PARTS.values():
                print(f"{part.name:18} {part.grid:7} {part.model:15} budgets {','.join(f'{b:g}' for b in part.budgets)}"
                      f"  ~{part.minutes:g} min")
            return 0
        if args.merge:
            from .merge import merge

            md, pngs = merge(args.merge, args.md, args.charts, command)
            print(f"wrote {md} and {len(pngs)} charts")
            return 0
        from ..common import out_dir
        from .grids import Settings
        from .run import run_part

        settings = Settings(**{k: v for k, v in dict(
            shape=args.shape, layers=args.layers, chunk=args.chunk, ttft_cap_s=args.ttft_cap_s, profile=args.profile,
            images=tuple(args.images.split(",")) if args.images else None,
            option_sets=tuple(args.option_sets.split(",")) if args.option_sets else None).items() if v is not None})
        path = run_part(args.part, args.out or out_dir(), settings, budgets=args.budgets, contexts=args.contexts,
                        batch_sizes=args.batch_sizes, deadline_s=args.deadline_s, command=command)
        print(f"wrote {path}")
        return 0
    except VramshardError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
