"""What the planner predicts with pinned weights kept coded in VRAM (``VRAMSHARD_VRAM_CODEC``) against raw pins,
for llama3-8b bf16 over budgets and machines: synthetic profiles of GPUs whose memory runs 288-1790 GB/s (a laptop's
to an RTX 5090's) beside a PCIe 4.0 or 5.0 link, and any profile files given. Predictions only (no GPU needed):
the GPU runs that check them are in docs/BENCHMARKS.md.

    PYTHONPATH=src:. python -m benchmarks.vram_codec_plans [--profile docs/profiles/h100-run40.json] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import torch

from vramshard.plan.mechanisms import Mechanisms, fixed_mechanisms
from vramshard.plan.planner import Planner
from vramshard.plan.tiers import Tiers
from vramshard.profile import load
from vramshard.profile.query import synthetic
from vramshard.shapes import shape_model

log = logging.getLogger("vram_codec_plans")
MACHINES = {  # GPU memory GB/s, host-to-device GB/s, CPU memory GB/s
    "laptop 288 GB/s, PCIe 4": (288, 25, 60),
    "desktop 504 GB/s, PCIe 4": (504, 25, 60),
    "desktop 1000 GB/s, PCIe 4": (1000, 25, 80),
    "desktop 1790 GB/s, PCIe 5": (1790, 50, 80),
}
TIERS = (1, 64, 1024)


def plan_cells(model, profile, budgets) -> list[dict]:
    cells = []
    for budget in budgets:
        row = {"budget_gib": budget}
        for codec in (False, True):
            began = time.perf_counter()
            with fixed_mechanisms(Mechanisms(False, False, False, (False, 0), False, False, codec)):
                plan = Planner(model, profile, budget * 2**30, context=1024, tiers=Tiers(TIERS)).plan()
            row["coded" if codec else "raw"] = {
                "predicted_ms": {t: plan.tiers[t].predicted_s * 1e3 for t in TIERS},
                "coded_sub_layers": len(plan.coded_names), "plan_s": time.perf_counter() - began,
                "pinned_weight_gib": sum(s.nbytes for n in plan.pinned for s in model[n].weights) / 2**30}
        cells.append(row)
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", action="append", default=[], help="a profile file too (repeatable)")
    parser.add_argument("--budgets", default="4,8,12", help="GiB, comma-separated")
    parser.add_argument("--out", help="write the cells as JSON here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model = shape_model("llama3-8b", torch.bfloat16)
    budgets = [int(b) for b in args.budgets.split(",")]
    profiles = {name: synthetic(cpu_gflops=1000, gpu_gflops=100_000, h2d_gbps=h2d, cpu_mem_gbps=cpu, gpu_mem_gbps=gpu)
                for name, (gpu, h2d, cpu) in MACHINES.items()}
    profiles.update({path: load(path, check_fingerprint=False) for path in args.profile})
    results = {}
    for name, profile in profiles.items():
        results[name] = plan_cells(model, profile, budgets)
        for row in results[name]:
            raw, coded = row["raw"], row["coded"]
            log.info("%-28s %3d GiB  raw %s ms  coded (%2d sub-layers, %.2f GiB of weights pinned) %s ms  (%.1f s)",
                     name, row["budget_gib"], " / ".join(f"{raw['predicted_ms'][t]:.1f}" for t in TIERS),
                     coded["coded_sub_layers"], coded["pinned_weight_gib"],
                     " / ".join(f"{coded['predicted_ms'][t]:.1f}" for t in TIERS), coded["plan_s"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"tiers": TIERS, "machines": MACHINES, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
