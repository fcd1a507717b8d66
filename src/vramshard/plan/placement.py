"""A placement: for every sub-layer, where it computes and where its weights live.

Plain data: printable, comparable, JSON round-trip. It knows sub-layer names and kinds,
nothing of tensors or streams. ``named_placement`` builds the baselines the planner must
beat: ``cpu``, ``gpu``, ``layers:N``, ``stream``, ``stream-hostkv`` (``stream`` with every KV
cache in host memory, staged through VRAM), ``static``, and for MoE models
``experts-cpu`` and ``experts-stream``.

A MoE ``ffn[i]`` may also be split: home ``experts`` keeps its norm and router in VRAM
(computed on the GPU) and says in ``Where.experts`` where its routed experts are handled:
``host`` (computed on the CPU from host memory, as llama.cpp ``--cpu-moe``) or ``cache``
(the experts a step routes to are copied into a VRAM expert cache and computed there).

An attention sub-layer computed on the GPU normally keeps its KV cache in VRAM beside it.
``Where.kv = "host"`` says instead that its KV cache lives in host memory and is staged
through a small VRAM cache for the step (:mod:`~vramshard.runtime.kv_staging`): prompt
chunks then run attention on the GPU while decode steps may still run it on the CPU, and
the KV cache never moves between tiers.

A sub-layer pinned in VRAM may be kept there coded (``Where.coded``, bf16 weights in about 0.754 of their
bytes, :mod:`~vramshard.runtime.vram_coded`): each step decodes it into a stream slot just before it computes,
so the same VRAM pins about a third more of the model.

A dense ``ffn[i]`` may be split between the CPU and the GPU inside the layer:
``Where("gpu", "stream", cpu_pieces=k)`` computes pieces ``0..k-1`` of its intermediate
dimension on the CPU from host memory while pieces ``k..P-1`` (P: the FFN's
``num_pieces``), streamed into a VRAM slot, compute on the GPU; the two halves add up
(:class:`~vramshard.layers.mlp.DenseFFN`). Its GPU part is what the slot ring streams.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable, Literal

from ..errors import InvalidInputError

Compute = Literal["cpu", "gpu"]
Home = Literal["vram", "stream", "host", "experts"]  # pinned in VRAM | streamed into a VRAM slot | host
# memory | MoE split: norm and router in VRAM, experts as ``Where.experts`` says
ExpertHome = Literal["host", "cache"]  # experts on the CPU | routed experts copied into the VRAM expert cache
KVHome = Literal["host"]  # GPU attention over a KV cache in host memory (None: the KV cache is beside the compute)
HOST_KV_TAG = "kv@host"  # how ``to_list`` / JSON write ``kv="host"``
CODED_TAG = "coded"  # how ``to_list`` / JSON write ``coded=True``

NAMED = ("cpu", "gpu", "layers:N", "layers:max", "stream", "stream-hostkv", "static", "experts-cpu",
         "experts-stream")


@dataclass(frozen=True)
class Where:
    """Placement of one sub-layer (or one expert piece)."""

    compute: Compute
    home: Home
    experts: ExpertHome | None = None  # only with home "experts"
    kv: KVHome | None = None  # only for GPU attention: "host" stages a host-memory KV cache through VRAM
    cpu_pieces: int | None = None  # only for a streamed dense FFN: its first pieces computed on the CPU
    coded: bool = False  # only for pinned weights: kept coded in VRAM, decoded into a stream slot each step

    def __post_init__(self):
        valid = {("cpu", "host"), ("gpu", "vram"), ("gpu", "stream"), ("gpu", "experts")}
        if (self.compute, self.home) not in valid:
            raise InvalidInputError(
                f"invalid placement compute={self.compute} home={self.home}: GPU compute reads weights "
                "from vram, a stream slot or (MoE) the expert split, CPU compute from host memory"
            )
        if (self.home == "experts") != (self.experts in ("host", "cache")):
            raise InvalidInputError(
                f"invalid placement home={self.home} experts={self.experts}: home 'experts' needs experts "
                "'host' or 'cache', and other homes take no experts field"
            )
        if self.kv not in (None, "host"):
            raise InvalidInputError(f"invalid placement kv={self.kv!r}: the only KV home to name is 'host' "
                                    "(leave it out for a KV cache beside the compute)")
        if self.kv == "host" and (self.compute != "gpu" or self.home not in ("vram", "stream")):
            raise InvalidInputError(
                f"invalid placement compute={self.compute} home={self.home} kv=host: a host-memory KV cache is "
                "named only for GPU attention with resident or streamed weights (CPU attention uses it anyway)")
        if self.cpu_pieces is not None:
            if isinstance(self.cpu_pieces, bool) or not isinstance(self.cpu_pieces, int) or self.cpu_pieces < 1:
                raise InvalidInputError(f"invalid placement cpu_pieces={self.cpu_pieces!r}: a split FFN computes a "
                                        "whole number >= 1 of its pieces on the CPU (leave it out for no split)")
            if (self.compute, self.home) != ("gpu", "stream") or self.kv is not None:
                raise InvalidInputError(
                    f"invalid placement compute={self.compute} home={self.home} cpu_pieces={self.cpu_pieces}: a split "
                    "FFN streams its GPU part (compute gpu, home stream) and has no KV cache")
        if self.coded not in (False, True):
            raise InvalidInputError(f"invalid placement coded={self.coded!r}: coded is true or false")
        if self.coded and (self.compute, self.home) != ("gpu", "vram"):
            raise InvalidInputError(
                f"invalid placement compute={self.compute} home={self.home} coded: only weights pinned in VRAM "
                "(compute gpu, home vram) are kept coded there")

    @property
    def split(self) -> bool:
        """A dense FFN split between the CPU (its first ``cpu_pieces`` pieces) and a stream slot."""
        return self.cpu_pieces is not None

    @property
    def kv_in_vram(self) -> bool:
        """Whether an attention sub-layer placed here keeps its KV cache in VRAM (GPU compute beside it)."""
        return self.compute == "gpu" and self.kv is None

    @property
    def stages_kv(self) -> bool:
        """GPU attention over a host-memory KV cache, staged through VRAM for the step."""
        return self.kv == "host"

    def __str__(self) -> str:
        if self.home == "experts":
            return "gpu+experts@cpu" if self.experts == "host" else "gpu+expert-cache"
        if self.split:
            return f"cpu:{self.cpu_pieces}+gpu+stream"
        text = {"host": "cpu", "vram": "gpu", "stream": "gpu+stream"}[self.home] + ("+coded" if self.coded else "")
        return text + "+kv@cpu" if self.kv == "host" else text

    def to_list(self) -> list:
        """[compute, home]; for the MoE split [compute, home, experts]; for GPU attention over a
        host KV cache [compute, home, "kv@host"]; for a split dense FFN [compute, home, cpu_pieces];
        pinned weights kept coded add "coded" (after "kv@host")."""
        return [self.compute, self.home] + ([self.experts] if self.experts else []) \
            + ([HOST_KV_TAG] if self.kv == "host" else []) + ([self.cpu_pieces] if self.split else []) \
            + ([CODED_TAG] if self.coded else [])

    @classmethod
    def from_list(cls, items: list) -> "Where":
        """Inverse of :meth:`to_list`."""
        if len(items) < 2 or len(items) > 4:
            raise InvalidInputError(f"a placement entry is [compute, home] with at most two more fields, got {items}")
        compute, home, *rest = items
        if CODED_TAG in rest:
            if rest not in ([CODED_TAG], [HOST_KV_TAG, CODED_TAG]):
                raise InvalidInputError(f"a coded placement entry is [compute, home(, kv@host), coded], got {items}")
            return cls(compute, home, kv="host" if rest[0] == HOST_KV_TAG else None, coded=True)
        if len(rest) > 1:
            raise InvalidInputError(f"a placement entry is [compute, home] with at most one more field, got {items}")
        if rest == [HOST_KV_TAG]:
            return cls(compute, home, kv="host")
        if len(rest) == 1 and isinstance(rest[0], int) and not isinstance(rest[0], bool):
            return cls(compute, home, cpu_pieces=rest[0])
        return cls(compute, home, *rest)


CPU = Where("cpu", "host")
GPU_RESIDENT = Where("gpu", "vram")
GPU_STREAMED = Where("gpu", "stream")
GPU_RESIDENT_HOST_KV = Where("gpu", "vram", kv="host")  # attention only: resident weights, KV staged from host
GPU_STREAMED_HOST_KV = Where("gpu", "stream", kv="host")  # attention only: streamed weights, KV staged from host
GPU_CODED = Where("gpu", "vram", coded=True)  # pinned coded, decoded into a stream slot each step
GPU_CODED_HOST_KV = Where("gpu", "vram", kv="host", coded=True)  # attention only: the same, KV staged from host
EXPERTS_CPU = Where("gpu", "experts", "host")
EXPERTS_CACHED = Where("gpu", "experts", "cache")


def split_ffn(cpu_pieces: int) -> Where:
    """A dense FFN split: its first ``cpu_pieces`` pieces on the CPU, the rest streamed to the GPU."""
    return Where("gpu", "stream", cpu_pieces=cpu_pieces)


@dataclass(frozen=True)
class Placement:
    """Where each sub-layer runs, in model order; ``name`` says how it was made."""

    name: str
    where: tuple[tuple[str, Where], ...]  # (sub-layer name, Where), model order

    def __post_init__(self):
        names = [n for n, _ in self.where]
        if len(set(names)) != len(names):
            raise InvalidInputError("a placement names a sub-layer twice")

    def __getitem__(self, sublayer: str) -> Where:
        return dict(self.where)[sublayer]

    def as_dict(self) -> dict[str, Where]:
        return dict(self.where)

    def names(self, home: Home | None = None, compute: Compute | None = None) -> list[str]:
        return [n for n, w in self.where if (home is None or w.home == home)
                and (compute is None or w.compute == compute)]

    @property
    def uses_gpu(self) -> bool:
        return any(w.compute == "gpu" for _, w in self.where)

    def staged_kv_names(self) -> list[str]:
        """Attention sub-layers computed on the GPU over a host-memory KV cache (staged through VRAM)."""
        return [n for n, w in self.where if w.stages_kv]

    def coded_names(self) -> list[str]:
        """Sub-layers pinned in VRAM coded (``Where.coded``): decoded into a stream slot each step."""
        return [n for n, w in self.where if w.coded]

    def split_names(self) -> list[str]:
        """Dense FFNs split between the CPU and the GPU (``Where.cpu_pieces``)."""
        return [n for n, w in self.where if w.split]

    def expert_names(self, experts: ExpertHome | None = None) -> list[str]:
        """MoE sub-layers split at their experts (home ``experts``), optionally of one expert home."""
        return [n for n, w in self.where if w.home == "experts" and (experts is None or w.experts == experts)]

    def to_data(self) -> dict:
        """The JSON-ready dict of :meth:`to_json`."""
        return {"name": self.name, "where": [[n, *w.to_list()] for n, w in self.where]}

    @classmethod
    def from_data(cls, data: dict) -> "Placement":
        """Inverse of :meth:`to_data` (InvalidInputError for anything else)."""
        try:
            return cls(data["name"], tuple((n, Where.from_list(rest)) for n, *rest in data["where"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidInputError(f"not a placement JSON document: {exc}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_data())

    @classmethod
    def from_json(cls, text: str) -> "Placement":
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise InvalidInputError(f"not a placement JSON document: {exc}") from None
        return cls.from_data(data)

    def __str__(self) -> str:
        lines = [f"placement {self.name}:"]
        for name, where in self.where:
            lines.append(f"  {name:<12} {str(where)}")
        return "\n".join(lines)

    def summary(self) -> str:
        """One line: how many sub-layers are on each side."""
        counts = {k: len(self.names(home=k)) for k in ("vram", "stream", "host")}
        counts["stream"] -= len(self.split_names())
        text = f"{self.name}: {counts['vram']} resident, {counts['stream']} streamed, {counts['host']} on CPU"
        if self.expert_names("host"):
            text += f", {len(self.expert_names('host'))} with experts on CPU"
        if self.expert_names("cache"):
            text += f", {len(self.expert_names('cache'))} with experts cached"
        if self.staged_kv_names():
            text += f", {len(self.staged_kv_names())} GPU attention over host KV"
        if self.split_names():
            text += f", {len(self.split_names())} FFNs split CPU/GPU"
        if self.coded_names():
            text += f", {len(self.coded_names())} of the resident coded"
        return text


def uniform(name: str, sublayers: Iterable[tuple[str, str, int | None]], choose) -> Placement:
    """Placement from ``choose(kind, layer) -> Where`` over (name, kind, layer) triples."""
    return Placement(name, tuple((n, choose(kind, layer)) for n, kind, layer in sublayers))


def named_placement(spec: str, sublayers: list[tuple[str, str, int | None]], num_layers: int,
                    max_layers: int | None = None, moe_layers: Iterable[int] | None = None) -> Placement:
    """Build a named baseline placement.

    sublayers: (name, kind, layer) in model order. ``layers:max`` needs ``max_layers``, the
    most whole layers that fit the budget (computed by the caller, who knows the sizes).
    ``experts-cpu`` / ``experts-stream`` need ``moe_layers``, the layers whose FFN is MoE
    (:func:`vramshard.plan.memory.moe_layers`).
    """
    spec = spec.strip().lower()
    if spec in ("experts-cpu", "experts-stream"):
        return _experts_placement(spec, sublayers, moe_layers)
    if spec == "cpu":
        return uniform("cpu", sublayers, lambda kind, layer: CPU)
    if spec == "gpu":
        return uniform("gpu", sublayers, lambda kind, layer: GPU_RESIDENT)
    if spec == "stream":
        # The embedding is a gather of a few rows: done on the CPU rather than streaming the table.
        return uniform("stream", sublayers, lambda kind, layer: CPU if kind == "embed" else GPU_STREAMED)
    if spec == "stream-hostkv":
        return uniform("stream-hostkv", sublayers, lambda kind, layer: CPU if kind == "embed"
                       else GPU_STREAMED_HOST_KV if kind == "attn" else GPU_STREAMED)
    if spec == "static":
        return uniform("static", sublayers, lambda kind, layer: GPU_RESIDENT if kind == "attn" else CPU)
    if spec.startswith("layers:"):
        count = spec.split(":", 1)[1]
        if count == "max":
            if max_layers is None:
                raise InvalidInputError("layers:max needs a VRAM budget to know how many layers fit")
            n = max_layers
        else:
            try:
                n = int(count)
            except ValueError:
                raise InvalidInputError(f"layers:N needs a whole number N, got {count!r}") from None
        if not 0 <= n <= num_layers:
            raise InvalidInputError(f"layers:N needs 0 <= N <= {num_layers} (the model's layers), got {n}")

        def choose(kind, layer):
            # As llama.cpp -ngl: whole layers on the GPU; the head too once every layer is there.
            if kind in ("attn", "ffn"):
                return GPU_RESIDENT if layer < n else CPU
            if kind == "head":
                return GPU_RESIDENT if n == num_layers else CPU
            return CPU

        return uniform(f"layers:{n}", sublayers, choose)
    raise InvalidInputError(f"unknown placement {spec!r}; choose one of {', '.join(NAMED)}")


def _experts_placement(spec: str, sublayers, moe_layers: Iterable[int] | None) -> Placement:
    """``experts-cpu``: everything on the GPU but the routed experts, computed on the CPU.
    ``experts-stream``: attention, routers and head resident, the embedding (a gather) on the
    CPU, routed experts copied into the VRAM expert cache."""
    moe = set(moe_layers or ())
    if not moe:
        raise InvalidInputError(f"placement {spec} is for Mixture-of-Experts models, and this model has no MoE "
                                "layers (or the caller did not say which); choose another placement")
    split = EXPERTS_CPU if spec == "experts-cpu" else EXPERTS_CACHED

    def choose(kind, layer):
        if kind == "ffn" and layer in moe:
            return split
        if kind == "embed" and spec == "experts-stream":
            return CPU
        return GPU_RESIDENT

    return uniform(spec, sublayers, choose)


@dataclass(frozen=True)
class TieredPlacement:
    """One placement per token tier, all with the same VRAM-resident sub-layers.

    A step of n new tokens runs the placement of the smallest tier >= n (the largest
    tier for anything bigger), with the tier's CPU thread count (None: unchanged).
    ``expert_cache``: bytes of the VRAM expert cache for placements that cache experts
    (0: the executor's default). ``zero_copy_cpu_shares``: per tier, of a decode-sized step's
    host-memory experts read by the GPU's zero-copy kernels, the share the CPU computes meanwhile
    (the executor's ``zero_copy_cpu_share``; empty: none in any tier). ``worker_threads``: per tier,
    the OpenMP team of the executor's run-ahead worker (None, or empty for every tier: one core fewer
    than the tier's threads, :func:`~vramshard.runtime.run_ahead.worker_threads`). ``packed``: per
    tier, whether dense FFNs' CPU work reads weights prepacked for oneDNN where the executor packs
    (:mod:`~vramshard.runtime.cpu_packed`; the planner packs only where the profile finds it faster;
    empty: every tier the executor packs at, as named placements run).
    """

    tiers: tuple[int, ...]
    placements: tuple[Placement, ...]
    threads: tuple[int | None, ...]
    expert_cache: int = 0
    zero_copy_cpu_shares: tuple[float, ...] = ()
    worker_threads: tuple[int | None, ...] = ()
    packed: tuple[bool, ...] = ()

    def __post_init__(self):
        if not (len(self.tiers) == len(self.placements) == len(self.threads)) or not self.tiers:
            raise InvalidInputError("a tiered placement needs one placement and thread count per tier")
        if self.zero_copy_cpu_shares and (len(self.zero_copy_cpu_shares) != len(self.tiers)
                                          or not all(0.0 <= s <= 1.0 for s in self.zero_copy_cpu_shares)):
            raise InvalidInputError("a tiered placement's zero-copy CPU shares need one share in [0, 1] per tier, "
                                    f"got {self.zero_copy_cpu_shares} for {len(self.tiers)} tiers")
        if self.worker_threads and (len(self.worker_threads) != len(self.tiers) or not all(
                t is None or (isinstance(t, int) and t >= 1) for t in self.worker_threads)):
            raise InvalidInputError("a tiered placement's worker threads need one count ≥ 1 (or null) per tier, "
                                    f"got {self.worker_threads} for {len(self.tiers)} tiers")
        if self.packed and (len(self.packed) != len(self.tiers) or not all(isinstance(p, bool) for p in self.packed)):
            raise InvalidInputError("a tiered placement's packed flags need one true/false per tier, "
                                    f"got {self.packed} for {len(self.tiers)} tiers")
        resident = {frozenset(p.names(home="vram")) for p in self.placements}
        if len(resident) != 1:
            raise InvalidInputError("every tier must keep the same sub-layers resident in VRAM")

    @classmethod
    def single(cls, placement: Placement) -> "TieredPlacement":
        return cls((1 << 62,), (placement,), (None,))

    @classmethod
    def every_tier(cls, placement: Placement, tiers: tuple[int, ...], packed: tuple[bool, ...]) -> "TieredPlacement":
        """``placement`` at each of ``tiers`` (a named placement: the same sub-layers on the same side at
        every step size), its dense FFNs' CPU work read from prepacked weights at the tiers ``packed`` says."""
        return cls(tuple(tiers), (placement,) * len(tiers), (None,) * len(tiers), packed=tuple(packed))

    def index_for(self, n_tokens: int) -> int:
        for i, size in enumerate(self.tiers):
            if n_tokens <= size:
                return i
        return len(self.tiers) - 1

    def for_tokens(self, n_tokens: int) -> tuple[Placement, int | None]:
        i = self.index_for(n_tokens)
        return self.placements[i], self.threads[i]

    def zero_copy_cpu_share(self, n_tokens: int) -> float:
        """The CPU's share of the zero-copy experts in a step of ``n_tokens`` (0: the kernels read all)."""
        return self.zero_copy_cpu_shares[self.index_for(n_tokens)] if self.zero_copy_cpu_shares else 0.0

    def worker_threads_for(self, n_tokens: int) -> int | None:
        """The run-ahead worker's team in a step of ``n_tokens`` (None: the default)."""
        return self.worker_threads[self.index_for(n_tokens)] if self.worker_threads else None

    def packs(self, n_tokens: int) -> bool:
        """Whether a step of ``n_tokens`` may read dense FFNs' CPU work from prepacked weights."""
        return self.packed[self.index_for(n_tokens)] if self.packed else True

    @property
    def name(self) -> str:
        if all(p == self.placements[0] for p in self.placements[1:]):
            return self.placements[0].name
        return "planned(" + ", ".join(f"{t}:{p.name}" for t, p in zip(self.tiers, self.placements)) + ")"

    @property
    def uses_gpu(self) -> bool:
        return any(p.uses_gpu for p in self.placements)

    def to_json(self) -> str:
        data = {"tiers": list(self.tiers), "threads": list(self.threads),
                "placements": [json.loads(p.to_json()) for p in self.placements]}
        if self.expert_cache:
            data["expert_cache"] = self.expert_cache
        if any(self.zero_copy_cpu_shares):
            data["zero_copy_cpu_shares"] = list(self.zero_copy_cpu_shares)
        if any(self.worker_threads):
            data["worker_threads"] = list(self.worker_threads)
        if self.packed:
            data["packed"] = list(self.packed)
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> "TieredPlacement":
        try:
            data = json.loads(text)
            return cls(tuple(data["tiers"]), tuple(Placement.from_json(json.dumps(p)) for p in data["placements"]),
                       tuple(data["threads"]), int(data.get("expert_cache", 0)),
                       tuple(float(s) for s in data.get("zero_copy_cpu_shares", ())),
                       tuple(data.get("worker_threads", ())), tuple(data.get("packed", ())))
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidInputError(f"not a tiered placement JSON document: {exc}") from None
