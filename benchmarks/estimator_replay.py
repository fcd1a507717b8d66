"""The estimator's figures that docs/BENCHMARKS.md cites for the fifteenth GPU session, computed on
any machine (no GPU) from the session's profiles and the factors its engines fitted:

    VRAMSHARD_CPU_PACKED=on PYTHONPATH=src python -m benchmarks.estimator_replay

- llama3-8b at 8 GiB (context 1088, the engine's tiers): the planner's tier-1 prediction with the
  factors the engine fitted (``{1: 2.0, 1024: 8.0}``) and with the one its tier-1 measurement asked
  for (``{1: 1.61}``); ``layers:17`` with that factor and without.
- qwen3-30b-a3b at 1K context: decode tok/s of ``experts-cpu``, ``experts-zero-copy`` and
  ``experts-zero-copy-cpu`` (share 0.315) with the profile call 1 planned from and with call 2's.
- The decode graphs' capture estimate of a lone nemo-8b attention at 128 and 1056 keys.
(``VRAMSHARD_CPU_PACKED=on`` as call 3 ran: the estimator then prices split parts as prepacked.)
"""

from __future__ import annotations

from pathlib import Path

from vramshard.plan.estimator import Estimator
from vramshard.plan.memory import moe_layers, sublayer_triples
from vramshard.plan.placement import named_placement
from vramshard.plan.planner import Planner
from vramshard.plan.tiers import Tiers
from vramshard.profile import load
from vramshard.runtime.graphs import capture_bytes
from vramshard.shapes import shape_model

PROFILES = Path(__file__).resolve().parent.parent / "docs" / "profiles"
GiB = 2**30
ENGINE_TIERS = Tiers((1, 4, 16, 64, 256, 512, 1024, 2048))


def main() -> None:
    run15 = load(PROFILES / "h200-run15.json", check_fingerprint=False)
    llama = shape_model("llama3-8b")
    for rows in ({1: 2.0, 1024: 8.0}, {1: 1.61}):
        plan = Planner(llama, run15.calibrated(cpu_rows=rows), 8 * GiB, context=1088, tiers=ENGINE_TIERS).plan()
        print(f"llama3-8b 8 GiB, CPU factors {rows}: planned tier 1 {plan.tiers[1].family} "
              f"{plan.tiers[1].predicted_s * 1e3:.1f} ms")
    layers17 = named_placement("layers:17", sublayer_triples(llama), llama.args.num_hidden_layers)
    for rows in ({1: 1.61}, {}):
        step = Estimator(llama, run15.calibrated(cpu_rows=rows) if rows else run15, 16).simulate(layers17, 1, 1088)
        print(f"llama3-8b layers:17, CPU factors {rows or 'none'}: {step.seconds * 1e3:.1f} ms, "
              f"CPU work {step.cpu_busy * 1e3:.1f} ms")
    moe = shape_model("qwen3-30b-a3b")
    experts_cpu = named_placement("experts-cpu", sublayer_triples(moe), moe.args.num_hidden_layers,
                                  moe_layers=moe_layers(moe))
    for name in ("h200-queued", "h200-run15"):
        profile = load(PROFILES / f"{name}.json", check_fingerprint=False)
        for label, zero_copy, share in (("experts-cpu", False, 0.0), ("experts-zero-copy", True, 0.0),
                                        ("experts-zero-copy-cpu", True, 0.31528728151031027)):
            estimator = Estimator(moe, profile, threads=16, expert_hit_rate=0.0, zero_copy=zero_copy,
                                  zero_copy_cpu_share=share)
            print(f"qwen3-30b-a3b {label} ({name}): {1 / estimator.simulate(experts_cpu, 1, 1024).seconds:.2f} tok/s")
    nemo = shape_model("nemo-8b")
    attention = next(s for s in nemo if s.kind == "attn")
    for keys in (128, 1056):
        print(f"nemo-8b lone attention, capture estimate at {keys} keys: "
              f"{capture_bytes([attention], 1, keys, nemo.dtype) / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
