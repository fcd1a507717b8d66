"""What the estimator and the planner make of the CPU's share of the zero-copy experts, by the
rate of the CPU's expert pass on the run-ahead worker (no GPU needed):

    PYTHONPATH=src python -m benchmarks.moe_share_replay [--profile docs/profiles/h200-run15.json]
                                                          [--slower 1,1.5,2.09] [--budget 8]

For each factor, the profile's pass rate on the worker is set to its rate alone over that factor
(a profile that measured the worker, ``host_experts_worker``, is also replayed as measured, factor
"measured"); then the estimator prices qwen3-30b-a3b's ``experts-cpu`` decode step (the GPU's
kernels reading host experts from pinned memory, 1K context) with 0 to top_k − 1 of each token's
experts on the worker, and the planner plans the model under the budget. Both run as they would
on a GPU machine with the run-ahead worker on and the zero-copy kernels available.
"""

from __future__ import annotations

import argparse
import copy
import time

from vramshard.plan.estimator import Estimator
from vramshard.plan.memory import moe_layers, sublayer_triples
from vramshard.plan.placement import named_placement
from vramshard.plan.planner import Planner
from vramshard.plan.tiers import Tiers
from vramshard.profile import load
from vramshard.profile.query import Profile
from vramshard.runtime import run_ahead, zero_copy_experts
from vramshard.shapes import shape_model

GiB = 2**30
CONTEXT = 1024  # decode at this context, as moe_bench's cells
TIERS = Tiers((1, 4, 16, 64, 256, 1024))  # moe_bench's planned cell's tiers


def with_worker_slower(profile: Profile, slower: float) -> Profile:
    data = copy.deepcopy(profile.data)
    data["host_experts_worker"] = {dtype: {rows: rate / slower for rows, rate in by_rows.items()}
                                   for dtype, by_rows in data["host_experts"].items()}
    return Profile(data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="docs/profiles/h200-run15.json")
    parser.add_argument("--slower", default="1,1.5,2.09", help="worker rate = rate alone / each of these")
    parser.add_argument("--budget", type=float, default=8.0, help="GiB")
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    args = parser.parse_args()
    zero_copy_experts.available = lambda: True  # (as on a GPU machine with the run-ahead worker on)
    run_ahead.available = lambda dense=False: True
    model = shape_model(args.shape)
    top_k = min(s.top_k for s in model if s.kind == "ffn" and hasattr(s, "top_k"))
    placement = named_placement("experts-cpu", sublayer_triples(model), model.args.num_hidden_layers,
                                moe_layers=moe_layers(model))
    stored = load(args.profile, check_fingerprint=False)
    cases = [(f"alone / {f}", with_worker_slower(stored, float(f))) for f in args.slower.split(",")]
    if stored.data.get("host_experts_worker"):
        cases.insert(0, ("measured", stored))
    print(f"{args.shape}, experts-cpu with zero-copy kernels, 1 token at {CONTEXT} context; profile {args.profile}")
    print("worker rate | predicted tok/s by experts on the CPU, " + " / ".join(map(str, range(top_k)))
          + f" of {top_k} | planner at {args.budget:g} GiB: tier 1 family, count (tok/s), seconds to plan")
    for label, profile in cases:
        tok_s = [1 / Estimator(model, profile, zero_copy=True, run_ahead=True, zero_copy_cpu_share=n / top_k)
                 .simulate(placement, 1, CONTEXT + 16).seconds for n in range(top_k)]
        started = time.perf_counter()
        plan = Planner(model, profile, int(args.budget * GiB), context=2 * CONTEXT + 16, tiers=TIERS).plan()
        took = time.perf_counter() - started
        decode = plan.tiers[1]
        print(f"{label} | " + " / ".join(f"{t:.2f}" for t in tok_s)
              + f" | {decode.family}, {round(decode.zero_copy_cpu_share * top_k)} ({1 / decode.predicted_s:.1f}), {took:.1f} s")


if __name__ == "__main__":
    main()
