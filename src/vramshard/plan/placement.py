"""A placement: for every sub-layer, where it computes and where its weights live.

Plain data: printable, comparable, JSON round-trip. It knows sub-layer names and kinds,
nothing of tensors or streams. ``named_placement`` builds the baselines the planner must
beat: ``cpu``, ``gpu``, ``layers:N``, ``stream``, ``static``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable, Literal

from ..errors import InvalidInputError

Compute = Literal["cpu", "gpu"]
Home = Literal["vram", "stream", "host"]  # pinned in VRAM | streamed into a VRAM slot | host memory

NAMED = ("cpu", "gpu", "layers:N", "layers:max", "stream", "static")


@dataclass(frozen=True)
class Where:
    """Placement of one sub-layer (or one expert piece)."""

    compute: Compute
    home: Home

    def __post_init__(self):
        valid = {("cpu", "host"), ("gpu", "vram"), ("gpu", "stream")}
        if (self.compute, self.home) not in valid:
            raise InvalidInputError(
                f"invalid placement compute={self.compute} home={self.home}: GPU compute reads weights "
                "from vram or a stream slot, CPU compute from host memory"
            )

    def __str__(self) -> str:
        return {"host": "cpu", "vram": "gpu", "stream": "gpu+stream"}[self.home]


CPU = Where("cpu", "host")
GPU_RESIDENT = Where("gpu", "vram")
GPU_STREAMED = Where("gpu", "stream")


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

    def to_json(self) -> str:
        return json.dumps({"name": self.name, "where": [[n, w.compute, w.home] for n, w in self.where]})

    @classmethod
    def from_json(cls, text: str) -> "Placement":
        try:
            data = json.loads(text)
            return cls(data["name"], tuple((n, Where(c, h)) for n, c, h in data["where"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidInputError(f"not a placement JSON document: {exc}") from None

    def __str__(self) -> str:
        lines = [f"placement {self.name}:"]
        for name, where in self.where:
            lines.append(f"  {name:<12} {str(where)}")
        return "\n".join(lines)

    def summary(self) -> str:
        """One line: how many sub-layers are on each side."""
        counts = {k: len(self.names(home=k)) for k in ("vram", "stream", "host")}
        return f"{self.name}: {counts['vram']} resident, {counts['stream']} streamed, {counts['host']} on CPU"


def uniform(name: str, sublayers: Iterable[tuple[str, str, int | None]], choose) -> Placement:
    """Placement from ``choose(kind, layer) -> Where`` over (name, kind, layer) triples."""
    return Placement(name, tuple((n, choose(kind, layer)) for n, kind, layer in sublayers))


def named_placement(spec: str, sublayers: list[tuple[str, str, int | None]], num_layers: int,
                    max_layers: int | None = None) -> Placement:
    """Build a named baseline placement.

    sublayers: (name, kind, layer) in model order. ``layers:max`` needs ``max_layers``, the
    most whole layers that fit the budget (computed by the caller, who knows the sizes).
    """
    spec = spec.strip().lower()
    if spec == "cpu":
        return uniform("cpu", sublayers, lambda kind, layer: CPU)
    if spec == "gpu":
        return uniform("gpu", sublayers, lambda kind, layer: GPU_RESIDENT)
    if spec == "stream":
        # The embedding is a gather of a few rows: done on the CPU rather than streaming the table.
        return uniform("stream", sublayers, lambda kind, layer: CPU if kind == "embed" else GPU_STREAMED)
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


@dataclass(frozen=True)
class TieredPlacement:
    """One placement per token tier, all with the same VRAM-resident sub-layers.

    A step of n new tokens runs the placement of the smallest tier >= n (the largest
    tier for anything bigger), with the tier's CPU thread count (None: unchanged).
    """

    tiers: tuple[int, ...]
    placements: tuple[Placement, ...]
    threads: tuple[int | None, ...]

    def __post_init__(self):
        if not (len(self.tiers) == len(self.placements) == len(self.threads)) or not self.tiers:
            raise InvalidInputError("a tiered placement needs one placement and thread count per tier")
        resident = {frozenset(p.names(home="vram")) for p in self.placements}
        if len(resident) != 1:
            raise InvalidInputError("every tier must keep the same sub-layers resident in VRAM")

    @classmethod
    def single(cls, placement: Placement) -> "TieredPlacement":
        return cls((1 << 62,), (placement,), (None,))

    def index_for(self, n_tokens: int) -> int:
        for i, size in enumerate(self.tiers):
            if n_tokens <= size:
                return i
        return len(self.tiers) - 1

    def for_tokens(self, n_tokens: int) -> tuple[Placement, int | None]:
        i = self.index_for(n_tokens)
        return self.placements[i], self.threads[i]

    @property
    def name(self) -> str:
        if len(self.placements) == 1:
            return self.placements[0].name
        return "planned(" + ", ".join(f"{t}:{p.name}" for t, p in zip(self.tiers, self.placements)) + ")"

    @property
    def uses_gpu(self) -> bool:
        return any(p.uses_gpu for p in self.placements)

    def to_json(self) -> str:
        return json.dumps({"tiers": list(self.tiers), "threads": list(self.threads),
                           "placements": [json.loads(p.to_json()) for p in self.placements]})

    @classmethod
    def from_json(cls, text: str) -> "TieredPlacement":
        try:
            data = json.loads(text)
            return cls(tuple(data["tiers"]), tuple(Placement.from_json(json.dumps(p)) for p in data["placements"]),
                       tuple(data["threads"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidInputError(f"not a tiered placement JSON document: {exc}") from None
