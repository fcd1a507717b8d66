"""The report's parts: which grid cells each runs, and why the grids are split where they are.

Each GPU call may run at most 10 minutes, so every part must finish in under 9 (each part also
stops starting cells at its ``deadline_s`` and records the rest as skipped, so it never runs
over). Per-cell times are estimated from the runs in docs/results-*.json (2026-11-29, H200 +
16-core Xeon):

nemo-8b fp16, one (budget, context) cell = the planned engine + the ``layers:max`` baseline:
  - executor build (pinned copy to VRAM at ~55 GB/s): ~2 s each;
  - decode, 2 warm-up + 5 steps at 3.5-6 tok/s (executor nemo-8b: 3.7-6.2 tok/s): ~2 s each;
  - TTFT: the planned engine streams prompt chunks through the GPU (``stream`` 1K prefill
    0.29 s), ~0.3 s per 1K tokens, 16K: ~5 s; ``layers:max`` prefills its CPU layers on the
    CPU (fp16: 13.9 s per 1K tokens at 2 GiB, 12.3 s at 4 GiB, 7.1 s at 8 GiB), so its TTFT is
    measured chunk by chunk and extrapolated once it would pass ``ttft_cap_s`` (15 s): at most
    one 1K chunk past the cap, ~15 s;
  => ~30 s per cell at 2-6 GiB, ~20 s at 8-16 GiB; plus per part: build and pin 15.7 GiB
  (~25 s: the llama3-8b executor run took 100 s for 10 cells), bandwidth probes and the
  profile fit (~10 s), the unconstrained run at each context (~10 s).
  dense-nemo-a (2, 4, 6 GiB: 9 cells) ~5.5 min; dense-nemo-b (8, 12, 16 GiB) ~4 min.

qwen3-30b-a3b bf16, one cell = planned + ``layers:max`` + ``experts-cpu`` (3 engines):
  build and pin 57 GiB piece by piece on the GPU (moe_bench.random_packed): ~1.5-2 min;
  per engine ~3 s build + ~2 s decode + TTFT up to the 15 s cap => up to ~60 s per cell.
  dense-qwen3moe-a (2, 4 GiB: 6 cells), -b (6, 8 GiB), -c (12, 16 GiB): ~6-8 min each.

batch-qwen3moe: 3 budgets x 3 engines x 4 batch sizes, each a fresh executor + 1 warm-up and
  3 decode steps at 64 tokens of context (16 at batch 1, 4 at batch 4: grids.steps_for): ~3-6 s
  per run => ~3.5 min + build ~2 min = ~5.5 min.
vlm: vramshard's VLM grid (vlm_bench.run_ours: 3 budgets x 5 option sets x 4 images), cut at
  the deadline (vlm_bench's own full run is sized to 510 s); vlm-hf: the transformers
  ``device_map="auto"`` baseline (vlm_bench.run_hf), ~6-8 min.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vramshard.errors import InvalidInputError

CONTEXTS = (1024, 4096, 16384)
DENSE_BUDGETS = (2, 4, 6, 8, 12, 16)
BATCH_BUDGETS = (2, 8, 16)
BATCH_SIZES = (1, 4, 16, 64)
VLM_BUDGETS = (2, 4, 8)


@dataclass(frozen=True)
class Part:
    """One part of the report: a grid, a model and the budgets it covers."""

    name: str
    grid: str  # "dense" | "batch" | "vlm" | "vlm-hf"
    model: str
    budgets: tuple[float, ...]
    contexts: tuple[int, ...] = CONTEXTS
    batch_sizes: tuple[int, ...] = BATCH_SIZES
    dtype: str | None = None  # None: the shape's own dtype
    minutes: float = 8.0  # expected wall time on the H200 machine
    deadline_s: float = 480.0  # no new cell starts after this (the call's limit is 600 s)
    options: dict = field(default_factory=dict)

    def command(self) -> str:
        return f"python -m benchmarks.report --part {self.name} --out $OUT"


PARTS: dict[str, Part] = {p.name: p for p in (
    Part("dense-nemo-a", "dense", "nemo-8b", (2, 4, 6), dtype="float16", minutes=5.5),
    Part("dense-nemo-b", "dense", "nemo-8b", (8, 12, 16), dtype="float16", minutes=4.5),
    Part("dense-qwen3moe-a", "dense", "qwen3-30b-a3b", (2, 4), dtype="bfloat16", minutes=8.0),
    Part("dense-qwen3moe-b", "dense", "qwen3-30b-a3b", (6, 8), dtype="bfloat16", minutes=8.0),
    Part("dense-qwen3moe-c", "dense", "qwen3-30b-a3b", (12, 16), dtype="bfloat16", minutes=7.0),
    Part("batch-qwen3moe", "batch", "qwen3-30b-a3b", BATCH_BUDGETS, dtype="bfloat16", minutes=5.5),
    Part("vlm", "vlm", "qwen2.5-vl-7b", VLM_BUDGETS, minutes=8.5),
    Part("vlm-hf", "vlm-hf", "qwen2.5-vl-7b", VLM_BUDGETS, minutes=7.0),
)}


def get_part(name: str) -> Part:
    try:
        return PARTS[name]
    except KeyError:
        raise InvalidInputError(f"unknown report part {name!r}; parts: {', '.join(PARTS)}") from None


def parts_of(grid: str, model: str | None = None) -> list[Part]:
    """The parts that together cover one grid (of one model)."""
    return [p for p in PARTS.values() if p.grid == grid and (model is None or p.model == model)]
