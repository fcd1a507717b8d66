"""What the profiler measures: the grids of shapes, sizes and thread counts.

``BenchmarkSpec.full()`` is the install-time profile (minutes on a 16-core + GPU machine);
``BenchmarkSpec.quick_spec()`` is a coarse one (on 2 cores ~40 s, ~65 s on a machine's first run,
which compiles the one-token CPU kernels). Tests build tiny
specs directly. Every table the estimator reads is a grid so it can be interpolated.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from ..errors import InvalidInputError

DTYPES = ("bf16", "fp16", "fp32")

# (hidden, intermediate, heads, kv_heads, head_dim) of the models vramshard targets.
MODEL_DIMS = {
    "llama-3.1-8b": (4096, 14336, 32, 8, 128),
    "minitron-8b": (4096, 16384, 32, 8, 128),
    "minitron-4b": (3072, 9216, 24, 8, 128),
    "qwen2.5-7b": (3584, 18944, 28, 4, 128),
    "qwen3-30b-a3b-expert": (2048, 768, 32, 4, 128),
    "qwen2.5-14b": (5120, 13824, 40, 8, 128),
}


def projection_shapes(hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int) -> list[tuple[int, int]]:
    """The ``(K, N)`` of every projection in one transformer block (``y[M, N] = x[M, K] @ W[K, N]``)."""
    return [
        (hidden, heads * head_dim),  # q_proj
        (hidden, kv_heads * head_dim),  # k_proj / v_proj
        (heads * head_dim, hidden),  # o_proj
        (hidden, intermediate),  # gate_proj / up_proj
        (intermediate, hidden),  # down_proj
    ]


def _dedupe(shapes) -> list[tuple[int, int]]:
    seen: dict[tuple[int, int], None] = {}
    for k, n in shapes:
        seen[(int(k), int(n))] = None
    return sorted(seen, key=lambda s: (s[0] * s[1], s))


# The top square is 5120² (26M weights, qwen2.5-14b's q_proj), no longer 8192²: unmeasured shapes
# are read by their weight count K·N, and 8192²'s (67.1M) is within 1.2% of qwen2.5-7b's FFN shapes,
# measured anyway. 5120² splits the widest gap, 4096² to the 4096 × 14336 FFN (16.8M to 58.7M),
# where the GPU leaves its launch floor and held-out shapes missed by 20-60%; it measures faster too.
SWEEP_SHAPES = [(256, 256), (512, 512), (1024, 1024), (2048, 2048), (5120, 5120)]

# The full grid: the projections of a few representative models plus a square sweep.
FULL_SHAPES = _dedupe(
    SWEEP_SHAPES
    + projection_shapes(*MODEL_DIMS["llama-3.1-8b"])
    + projection_shapes(*MODEL_DIMS["qwen2.5-7b"])[1:2]  # kv with 4 heads: the narrowest
    + projection_shapes(*MODEL_DIMS["qwen2.5-7b"])[3:]
    + projection_shapes(*MODEL_DIMS["qwen3-30b-a3b-expert"])[3:]
)
QUICK_SHAPES = _dedupe([(512, 512), (2048, 768), (3584, 512), (4096, 1024), (4096, 4096), (4096, 14336), (14336, 4096)])


def default_thread_counts(max_threads: int | None = None) -> list[int]:
    """Powers of two up to all cores, plus all cores: ``[1, 2, 4, 8, 12]`` for 12."""
    import torch

    top = max_threads or torch.get_num_threads() or os.cpu_count() or 1
    counts = {top}
    power = 1
    while power < top:
        counts.add(power)
        power *= 2
    return sorted(counts)


@dataclass
class BenchmarkSpec:
    """One profiling run's grids and time limits.

    ``shapes`` × ``ms`` × ``dtypes`` is measured on each device at all cores (the full
    tables). Other thread counts and the CPU-under-PCIe-load case are measured on the
    smaller ``ratio_shapes`` × ``ratio_ms`` grid (a subset), and read as ratios to the full
    table. ``point_budget_s`` bounds the repeats of one point; a point whose predicted
    single run exceeds ``point_cap_s`` is not run but extrapolated at the throughput of
    the last measured point (counted in the table's ``estimated``).
    """

    # Every power of two: the decode tiers 1, 4, 16, 64 and prompt tiers 256-2048, and the decode
    # batches between them. 32 came first, splitting the widest gap where CPU kernels change shape
    # (held-out error there was 30-50% without it); 2, 8 and 128 came after the fifth check, whose
    # misses of 20-37% were at M = 3, 48 and 128, where kernels change between grid points.
    ms: list[int] = field(default_factory=lambda: [2**i for i in range(12)])
    shapes: list[tuple[int, int]] = field(default_factory=lambda: list(FULL_SHAPES))
    dtypes: list[str] = field(default_factory=lambda: list(DTYPES))
    threads: list[int] | None = None  # None: default_thread_counts()
    ratio_shapes: list[tuple[int, int]] = field(default_factory=lambda: [(1024, 1024), (4096, 4096), (4096, 14336)])
    ratio_ms: list[int] = field(default_factory=lambda: [1, 16, 256, 2048])
    transfer_sizes: list[int] = field(default_factory=lambda: [2**k for k in range(16, 31, 2)])  # 64 KiB .. 1 GiB
    # 4: one new token reads the cache with no mask, more need one, and from 2 to ~8 the time rises
    # little (2-core development machine, session 25: 2.0, 4.4, 4.8, 6.2, 9.7 ms at 1, 2, 4, 8, 16
    # new tokens over 3000); between 1 and 16 alone a held-out 8 was predicted 20-40% fast (the
    # seventeenth GPU session's checks, CPU).
    attention_n_new: list[int] = field(default_factory=lambda: [1, 4, 16, 128, 1024])
    attention_context: list[int] = field(default_factory=lambda: [512, 2048, 8192, 32768])
    attention_heads: list[tuple[int, int, int]] = field(default_factory=lambda: [(32, 8, 128)])
    point_budget_s: float = 0.08
    point_cap_s: float = 0.6
    gpu_point_budget_s: float = 0.02
    cpu_contention: bool = True
    # (hidden, intermediate) of the dense FFN whose split CPU part is timed against the whole
    # (see bench_split.py); None: not measured (the estimator then assumes no penalty).
    split_ffn: tuple[int, int] | None = (4096, 14336)
    # Rows at which that FFN is timed from oneDNN-prepacked weights against plain ones (see
    # bench_packed.py; the estimator's factor where VRAMSHARD_CPU_PACKED is on); empty: not measured.
    # Decode-sized rows only: prompt chunks compute plain parts (runtime/cpu_packed.py).
    packed_rows: list[int] = field(default_factory=lambda: [1, 16, 64])
    # (hidden, intermediate, top_k) of the MoE layer whose routed experts are timed in the compiled
    # pass against the expert-by-expert path (see bench_experts.py), at these rows; None: not measured.
    host_experts: tuple[int, int, int] | None = (2048, 768, 8)
    host_expert_rows: list[int] = field(default_factory=lambda: [1, 4, 16])
    gpu: bool | None = None  # None: measure the GPU when CUDA is available
    # Rounds of the all-cores CPU tables (matmul, attention), minutes apart: each point keeps its
    # fastest round. A shared host's CPU drifts over minutes (the H200 machine's moved 6-31% between
    # two runs, and 19% between probes of one shape within a check): other load only ever slows a
    # run, and one round took a slow spell for the machine's speed at up to half its points.
    cpu_rounds: int = 2
    quick: bool = False

    @classmethod
    def full(cls, **overrides) -> "BenchmarkSpec":
        """The install-time profile (designed for ≤ 5 min on 16 cores + one GPU)."""
        return replace(cls(), **overrides)

    @classmethod
    def quick_spec(cls, **overrides) -> "BenchmarkSpec":
        """A coarse profile: a few shapes and sizes, short timings, all cores only (on 2 cores ~40 s;
        a machine's first run also compiles the one-token kernels: ~65 s)."""
        spec = cls(
            ms=[1, 4, 16, 64, 256, 1024],  # 2048 rows: twice 1024's time (compute-bound, see tables.py)
            shapes=list(QUICK_SHAPES),
            ratio_shapes=[(4096, 1024), (4096, 4096)],
            ratio_ms=[1, 64, 1024],
            transfer_sizes=[2**16, 2**20, 2**24, 2**26],
            attention_n_new=[1, 8, 64],
            attention_context=[512, 4096],
            point_budget_s=0.06,
            point_cap_s=0.15,
            gpu_point_budget_s=0.01,
            split_ffn=(1024, 4096),
            packed_rows=[1, 64],
            host_experts=(1024, 512, 4),
            host_expert_rows=[1],
            cpu_rounds=1,
            quick=True,
        )
        return replace(spec, **overrides)

    def with_extra_shapes(self, shapes) -> "BenchmarkSpec":
        """A copy that also measures the given ``(K, N)`` shapes (e.g. a model's projections)."""
        return replace(self, shapes=_dedupe(list(self.shapes) + [tuple(s) for s in shapes]))

    def resolved_threads(self) -> list[int]:
        """Thread counts to measure, ascending; the last one is "all cores".

        A quick profile measures all cores only (the estimator scales fewer threads linearly from
        it): each (half-precision dtype, thread count) costs a compilation of the one-token
        kernel, ~5 s cold on 2 cores, and a cold quick profile took 85 s with 1 and 2 threads."""
        if self.threads:
            threads = sorted(set(self.threads))
        else:
            threads = default_thread_counts()[-1:] if self.quick else default_thread_counts()
        if threads[0] < 1:
            raise InvalidInputError(f"thread counts must be ≥ 1, got {threads}")
        return threads

    def validate(self) -> None:
        """Raise InvalidInputError if the grids are inconsistent."""
        unknown = [d for d in self.dtypes if d not in DTYPES]
        if unknown:
            raise InvalidInputError(f"unknown dtype(s) {unknown}; use some of {list(DTYPES)}")
        if self.cpu_rounds < 1:
            raise InvalidInputError(f"cpu_rounds must be ≥ 1, got {self.cpu_rounds}")
        if not self.ms or not self.shapes or not self.dtypes:
            raise InvalidInputError("a benchmark spec needs at least one M, one shape and one dtype")
        shapes = {tuple(s) for s in self.shapes}
        if not {tuple(s) for s in self.ratio_shapes} <= shapes or not set(self.ratio_ms) <= set(self.ms):
            raise InvalidInputError("ratio_shapes and ratio_ms must be subsets of shapes and ms")


def torch_dtype(name: str):
    """``torch.bfloat16`` for ``"bf16"``, and so on."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]
