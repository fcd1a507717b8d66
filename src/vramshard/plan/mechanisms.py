"""How the executor of this process will run the work an estimator prices: each mechanism read from its own switch
(``VRAMSHARD_*``, and whether there is a GPU beside it), or fixed for a planning process by the engine's
(:func:`fixed_mechanisms`; :mod:`~vramshard.runtime.plan_process` sends them over in :meth:`Mechanisms.to_wire`)."""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch

from ..layers import cpu_gemv as gemv_kernel


@dataclass(frozen=True)
class Mechanisms:
    """How the executor of this process will run the work an estimator prices (see the module)."""

    run_ahead: bool  # MoE layers' host experts on the run-ahead worker
    cpu_packed: bool
    cpu_gemv: bool
    zero_copy: tuple[bool, int]
    run_ahead_dense: bool = False  # split dense FFNs' CPU parts too
    wire_codec: bool = False  # bf16 stream fills coded (runtime/wire_codec)
    vram_codec: bool = False  # pinned bf16 weights may be kept coded in VRAM (runtime/vram_coded)
    decode_graphs: bool = False  # decode steps replay runs of resident sub-layers from CUDA graphs (runtime/graphs)
    run_ahead_bound: bool = False  # split dense FFNs' CPU parts that run as one bound C call (few rows, the C kernel)
    fill_graphs: bool = True  # coded stream fills replayed from CUDA graphs (runtime/wire_codec.FILL_GRAPHS)
    amx: bool = False  # bf16 FFN work of a few dozen rows through the CPU's matrix tiles (layers/cpu_gemv.amx)

    @classmethod
    def here(cls) -> "Mechanisms":
        """This process's (or the fixed ones)."""
        return cls(run_ahead_enabled(), cpu_packed_enabled(), cpu_gemv_enabled(), zero_copy_enabled(),
                   run_ahead_enabled(dense=True), wire_codec_enabled(), vram_codec_enabled(),
                   decode_graphs_enabled(), run_ahead_bound_enabled(), fill_graphs_enabled(), amx_enabled())

    def to_wire(self) -> dict:
        """As plain data, for a planning request (:mod:`~vramshard.runtime.plan_wire`)."""
        return {**dataclasses.asdict(self), "zero_copy": list(self.zero_copy)}

    @classmethod
    def from_wire(cls, data: dict) -> "Mechanisms":
        """Those :meth:`to_wire` gave; a mechanism the data lacks takes its default. KeyError, TypeError or
        ValueError where the data is not such."""
        names = {field.name for field in dataclasses.fields(cls)}
        if not names.issuperset(data):
            raise ValueError(f"mechanisms unknown here: {sorted(set(data) - names)}")
        values = {name: bool(value) for name, value in data.items() if name != "zero_copy"}
        return cls(**values, zero_copy=(bool(data["zero_copy"][0]), int(data["zero_copy"][1])))


_fixed: Mechanisms | None = None


@contextlib.contextmanager
def fixed_mechanisms(mechanisms: Mechanisms):
    """Estimators made inside price ``mechanisms``, not this process's switches."""
    global _fixed
    before, _fixed = _fixed, mechanisms
    try:
        yield
    finally:
        _fixed = before


def pricing_graphs(on: bool):
    """Estimators made inside price decode graphs ``on`` or not, the other mechanisms as this process's."""
    return fixed_mechanisms(dataclasses.replace(Mechanisms.here(), decode_graphs=on))


def run_ahead_enabled(dense: bool = False) -> bool:
    """Whether the executor will hand MoE layers' host experts (or, ``dense``, every split dense FFN's CPU
    part) to its run-ahead worker (read when an estimator is made: the benchmarks switch it per
    placement)."""
    if _fixed is not None:
        return _fixed.run_ahead_dense if dense else _fixed.run_ahead
    from ..runtime import run_ahead  # (the mechanism's own switch; nothing else of it is used here)

    return run_ahead.available(dense) and (run_ahead.DENSE or not dense)


def run_ahead_bound_enabled() -> bool:
    """Whether the executor will hand its run-ahead worker the split dense FFNs' CPU parts that run as one bound
    C call (``VRAMSHARD_RUN_AHEAD=bound``: few rows through the C kernel; :func:`~vramshard.runtime.run_ahead.
    bound_part`)."""
    if _fixed is not None:
        return _fixed.run_ahead_bound
    from ..runtime import run_ahead

    return run_ahead.available(dense=True) and run_ahead.BOUND and run_ahead.ONE_CALL


def cpu_packed_enabled() -> bool:
    """Whether the executor will compute dense FFNs on the CPU from prepacked weights
    (``VRAMSHARD_CPU_PACKED``: on, or auto beside a CUDA GPU; where oneDNN is there)."""
    if _fixed is not None:
        return _fixed.cpu_packed
    from ..runtime import cpu_packed  # (the mechanism's own switch)

    return cpu_packed.packs()


def cpu_packed_forced() -> bool:
    """Whether packing was asked for outright (``VRAMSHARD_CPU_PACKED=on``: every part packed, whatever
    the profile says it gains); never under :func:`fixed_mechanisms`."""
    if _fixed is not None:
        return False
    from ..runtime import cpu_packed  # (the mechanism's own switch)

    return cpu_packed.MODE == "on" and cpu_packed.packs()


def wire_codec_enabled() -> bool:
    """Whether the executor will stream bf16 weights coded (``VRAMSHARD_WIRE_CODEC``): each fill then
    crosses the link in :data:`~vramshard.runtime.wire_codec.RATIO` of its bytes."""
    if _fixed is not None:
        return _fixed.wire_codec
    from ..runtime import wire_codec  # (the mechanism's own switch)

    return wire_codec.enabled()


def fill_graphs_enabled() -> bool:
    """Whether the executor will replay coded stream fills from CUDA graphs (``VRAMSHARD_FILL_GRAPHS``) rather
    than issue them round by round: the host's cost of each fill."""
    if _fixed is not None:
        return _fixed.fill_graphs
    from ..runtime import wire_codec  # (the mechanism's own switch)

    return wire_codec.FILL_GRAPHS


def amx_enabled() -> bool:
    """Whether the executor will compute bf16 FFN work of a few dozen rows through the CPU's matrix tiles
    (``VRAMSHARD_CPU_AMX``, where the tiles are: :func:`~vramshard.layers.cpu_gemv.amx`)."""
    if _fixed is not None:
        return _fixed.amx
    return gemv_kernel.amx()


def vram_codec_enabled() -> bool:
    """Whether the planner may keep pinned bf16 weights coded in VRAM (``VRAMSHARD_VRAM_CODEC``)."""
    if _fixed is not None:
        return _fixed.vram_codec
    from ..runtime import vram_coded  # (the mechanism's own switch)

    return vram_coded.enabled()


def decode_graphs_enabled() -> bool:
    """Whether the executor will replay decode steps over runs of resident sub-layers from CUDA graphs: as an
    engine does by default (``Engine.load(decode_graphs=True)``) wherever this process has a CUDA GPU; an
    engine that runs them eagerly plans under :func:`fixed_mechanisms` saying so."""
    if _fixed is not None:
        return _fixed.decode_graphs
    return torch.cuda.is_available()


def cpu_gemv_enabled() -> bool:
    """Whether the executor will compute one-row dense FFNs and split parts on the CPU by the C kernel
    from the plain weights (``VRAMSHARD_CPU_GEMV``: on, or auto beside a CUDA GPU; where it builds),
    rather than from prepacked ones."""
    if _fixed is not None:
        return _fixed.cpu_gemv
    return gemv_kernel.computes(1)  # (the kernel's own switch)


def zero_copy_enabled() -> tuple[bool, int]:
    """Whether the executor's GPU kernels will read host-memory experts themselves
    (``VRAMSHARD_EXPERTS_ZERO_COPY``), and up to how many tokens a step."""
    if _fixed is not None:
        return _fixed.zero_copy
    from ..runtime import zero_copy_experts  # (the mechanism's own switch and limit)

    return zero_copy_experts.available(), zero_copy_experts.ROWS
