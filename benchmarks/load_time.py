"""Where a planned engine's load goes (``Engine.load_seconds``): a named shape with random weights,
cut to a few layers, planned under a budget from a machine profile, on the GPU or a simulated one
(no GPU needed), with inductor's compile cache cold (an empty directory) and then warm (the same
directory, a second process).

    PYTHONPATH=src python -m benchmarks.load_time --shape nemo-8b --layers 6 --vram 1.5 \\
        --profile docs/profiles/h200-run26b.json --simulate --json load_time.json

Each load runs in a child process (the in-process caches would make the second load warm whatever
the disk holds); the parent prints the phases of both.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from .common import hardware, now, write_json

GiB = 2**30


def load_once(args) -> dict:
    """One load in this process: wall seconds and the engine's phases."""
    import torch

    from vramshard import Engine
    from vramshard.models import build_model
    from vramshard.profile import load
    from vramshard.shapes import random_weights, shape_config

    config = shape_config(args.shape)
    config["num_hidden_layers"] = args.layers
    model = build_model(config, torch.float16 if args.dtype == "float16" else torch.bfloat16)
    weights = random_weights(model)
    profile = load(args.profile, check_fingerprint=False) if args.profile else None
    start = time.perf_counter()
    engine = Engine.from_weights(model, weights, None, name=args.shape, vram=int(args.vram * GiB),
                                 simulate_gpu=args.simulate, profile=profile, max_context=args.ctx)
    return {"wall_s": time.perf_counter() - start, "load_seconds": engine.load_seconds,
            "placement": engine.executor.plans.name}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="nemo-8b")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    parser.add_argument("--vram", type=float, default=1.5, help="GiB")
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--profile", default=None)
    parser.add_argument("--simulate", action="store_true", help="plan and run as on a GPU, on the CPU")
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(load_once(args)))
        return
    cache = tempfile.mkdtemp(prefix="vramshard-inductor-")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    runs = {}
    for cache_state in ("cold", "warm"):
        out = subprocess.run([sys.executable, "-m", "benchmarks.load_time", *sys.argv[1:], "--child"], env=env,
                             capture_output=True, text=True, check=True).stdout
        runs[cache_state] = json.loads(out.strip().splitlines()[-1])
        phases = ", ".join(f"{k} {v:.1f} s" for k, v in runs[cache_state]["load_seconds"].items())
        print(f"{cache_state} compile cache: load {runs[cache_state]['wall_s']:.1f} s ({phases})")
    if args.json:
        write_json(args.json, {"date": now(), "hardware": hardware(), "args": vars(args), "runs": runs})


if __name__ == "__main__":
    main()
