"""``ffn[i]`` for dense models: pre-norm, SwiGLU MLP, residual.

The MLP is also a sum of ``pieces`` along its intermediate dimension: piece p is rows
``bounds[p]:bounds[p+1]`` of gate and up and the same columns of down, and the FFN's output is
``x + sum over pieces of contribution(piece, norm(x))``. A *split* FFN computes some pieces on
the CPU and the others on the GPU (:meth:`DenseFFN.pieces_of`, :meth:`DenseFFN.contribution`).
Its ``down_proj`` is stored transposed ([F, D], see ``stored_transposed``) so each piece's
columns are contiguous rows in memory; ``forward`` receives it as the usual [D, F] (a
transposed view) and does not care.
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F

from ..config import ModelArgs
from . import cpu_gemv, cpu_swiglu
from .norm import rms_norm
from .step import Step
from .sublayer import Cost, SubLayer, WeightSpec, linear


def swiglu(h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """``down(silu(gate(h)) * up(h))``; on the CPU at up to four rows by the C kernel where it serves
    (:mod:`.cpu_gemv`); where it does not take FFN work, at a few rows as one compiled call where that was
    measured faster (:mod:`.cpu_swiglu`)."""
    if h.device.type == "cpu" and cpu_gemv.serves_swiglu(h, gate, up, down):
        return cpu_gemv.swiglu(h, gate, up, down)
    if not cpu_swiglu.wanted(h):
        return _swiglu(h, gate, up, down)
    return cpu_swiglu.swiglu(h, gate, up, down, lambda: _swiglu(h, gate, up, down))


def _swiglu(h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return linear(F.silu(linear(h, gate)) * linear(h, up), down)


def swiglu_fused(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The same with gate and up stacked in one [2F, D] weight: one matmul instead of two."""
    if h.device.type == "cpu" and cpu_gemv.computes(h.shape[0]):
        gate, up = gate_up.chunk(2, dim=0)
        if cpu_gemv.serves_swiglu(h, gate, up, down):
            return cpu_gemv.swiglu(h, gate, up, down)
    if not cpu_swiglu.wanted(h):
        return _swiglu_fused(h, gate_up, down)
    gate, up = gate_up.chunk(2, dim=0)
    return cpu_swiglu.swiglu(h, gate, up, down, lambda: _swiglu_fused(h, gate_up, down), (gate_up, down))


def _swiglu_fused(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = linear(h, gate_up).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, down)


def swiglu_into(h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, out: torch.Tensor,
                work: torch.Tensor) -> torch.Tensor:
    """``swiglu`` into given buffers: the gate and up products in the flat ``work`` (at least
    2·T·r elements, r: rows of gate), the result in ``out`` [T, D]; nothing is allocated (except
    by the compiled call, where chosen: :mod:`.cpu_swiglu`; the products here are plain ``torch.mm``,
    with no path choice of their own to wait for). Where the C kernel serves (:mod:`.cpu_gemv`), its call."""
    if h.device.type == "cpu" and cpu_gemv.serves_swiglu(h, gate, up, down):
        return _into(out, cpu_gemv.swiglu(h, gate, up, down))
    if not cpu_swiglu.wanted(h):
        return _swiglu_into(h, gate, up, down, out, work)
    return _into(out, cpu_swiglu.swiglu(h, gate, up, down, lambda: _swiglu_into(h, gate, up, down, out, work), ()))


def _swiglu_into(h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, out: torch.Tensor,
                 work: torch.Tensor) -> torch.Tensor:
    rows, width = h.shape[0], gate.shape[0]
    gated = work[:rows * width].view(rows, width)
    lifted = work[rows * width:2 * rows * width].view(rows, width)
    torch.mm(h, gate.t(), out=gated)
    torch.mm(h, up.t(), out=lifted)
    return _gated_down(gated, lifted, down, out)


def swiglu_fused_into(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, out: torch.Tensor,
                      work: torch.Tensor) -> torch.Tensor:
    """``swiglu_fused`` into given buffers (``work``: at least T·2F elements, flat)."""
    gate, up = gate_up.chunk(2, dim=0)
    if h.device.type == "cpu" and cpu_gemv.serves_swiglu(h, gate, up, down):
        return _into(out, cpu_gemv.swiglu(h, gate, up, down))
    if not cpu_swiglu.wanted(h):
        return _swiglu_fused_into(h, gate_up, down, out, work)
    return _into(out, cpu_swiglu.swiglu(h, gate, up, down, lambda: _swiglu_fused_into(h, gate_up, down, out, work), ()))


def _swiglu_fused_into(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, out: torch.Tensor,
                       work: torch.Tensor) -> torch.Tensor:
    rows, width = h.shape[0], gate_up.shape[0]
    both = work[:rows * width].view(rows, width)
    torch.mm(h, gate_up.t(), out=both)
    gated, lifted = both.chunk(2, dim=-1)  # [T, F] views with a row stride of 2F
    return _gated_down(gated, lifted, down, out)


def _into(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``out`` holding ``y`` (the projections wrote it there already; the compiled call did not)."""
    return out if y is out else out.copy_(y)


def _gated_down(gated: torch.Tensor, lifted: torch.Tensor, down: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    F.silu(gated, inplace=True)
    gated.mul_(lifted)
    return torch.mm(gated, down.t(), out=out)


DEFAULT_PIECES = 16  # pieces of a dense FFN along its intermediate dimension (the split's granularity)


def piece_bounds(intermediate: int, pieces: int) -> tuple[int, ...]:
    """``pieces + 1`` row boundaries cutting ``intermediate`` rows into near-equal pieces."""
    pieces = max(1, min(pieces, intermediate))
    return tuple(round(p * intermediate / pieces) for p in range(pieces + 1))


class DenseFFN(SubLayer):
    kind = "ffn"
    fusable = {"gate_up_proj": ("gate_proj", "up_proj")}
    # Keys whose host (and VRAM) storage is the transpose of ``WeightSpec.shape``: down_proj as
    # [F, D], so the columns of a piece (a range of the intermediate dimension) lie together.
    stored_transposed = ("down_proj",)

    def __init__(self, args: ModelArgs, layer: int, prefix: str, dtype: torch.dtype, pieces: int = DEFAULT_PIECES):
        self.eps = args.rms_norm_eps
        d, f = args.hidden_size, args.intermediate_size
        super().__init__(f"ffn[{layer}]", layer, [
            WeightSpec("post_attention_layernorm", f"{prefix}.post_attention_layernorm.weight", (d,), dtype),
            WeightSpec("gate_proj", f"{prefix}.mlp.gate_proj.weight", (f, d), dtype),
            WeightSpec("up_proj", f"{prefix}.mlp.up_proj.weight", (f, d), dtype),
            WeightSpec("down_proj", f"{prefix}.mlp.down_proj.weight", (d, f), dtype),
        ])
        self.hidden, self.intermediate = d, f
        self.bounds = piece_bounds(f, pieces)  # [P + 1] row boundaries of the pieces

    @property
    def num_pieces(self) -> int:
        return len(self.bounds) - 1

    launches = 9

    def matmuls(self, n_tokens: int) -> list[tuple[float, int, int]]:
        return [(n_tokens, self.hidden, 2 * self.intermediate), (n_tokens, self.intermediate, self.hidden)]

    def cost(self, n_tokens: int, context: int) -> Cost:
        itemsize = self.weights[0].dtype.itemsize
        return Cost(flops=2 * n_tokens * 3 * self.hidden * self.intermediate, weight_bytes=self.nbytes,
                    act_bytes=2 * n_tokens * self.hidden * itemsize)

    def part_matmuls(self, n_tokens: int, first: int, last: int) -> list[tuple[float, int, int]]:
        """The matmuls of pieces ``[first, last)`` alone."""
        rows = self.bounds[last] - self.bounds[first]
        return [(n_tokens, self.hidden, 2 * rows), (n_tokens, rows, self.hidden)] if rows else []

    def part_bytes(self, first: int, last: int) -> int:
        """Weight bytes of pieces ``[first, last)`` (gate, up and down rows; no norm)."""
        rows = self.bounds[last] - self.bounds[first]
        return 3 * rows * self.hidden * self.weights[0].dtype.itemsize

    def forward(self, w: Mapping[str, torch.Tensor], x: torch.Tensor, step: Step) -> torch.Tensor:
        return x + self.contribution(w, self.norm(w, x))

    def norm(self, w: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """The pre-norm of ``x`` (computed once per step, whatever the pieces)."""
        return rms_norm(x, w["post_attention_layernorm"], self.eps)

    def contribution(self, w: Mapping[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        """SwiGLU of the normalized ``h`` [T, D] with the gate/up/down of ``w`` (the whole FFN or some
        of its pieces, e.g. :meth:`pieces_of`): that part's share of the output, no residual."""
        if "gate_up_proj" in w:
            return swiglu_fused(h, w["gate_up_proj"], w["down_proj"])
        return swiglu(h, w["gate_proj"], w["up_proj"], w["down_proj"])

    def contribution_into(self, w: Mapping[str, torch.Tensor], h: torch.Tensor, out: torch.Tensor,
                          work: torch.Tensor) -> torch.Tensor:
        """:meth:`contribution` written into ``out`` [T, D], with the flat ``work`` (at least
        :meth:`work_elements`) for the gate and up products: nothing is allocated."""
        if "gate_up_proj" in w:
            return swiglu_fused_into(h, w["gate_up_proj"], w["down_proj"], out, work)
        return swiglu_into(h, w["gate_proj"], w["up_proj"], w["down_proj"], out, work)

    def contribution_part(self, w: Mapping[str, torch.Tensor], h: torch.Tensor,
                          out: torch.Tensor) -> cpu_gemv.BoundPart | None:
        """:meth:`contribution` of ``h`` [T, D] into ``out`` as one bound C call, where the C kernel computes it
        from ``w`` as it lies (host memory, a few rows): the run-ahead worker runs it with ``h``'s values still
        on their way (:func:`~vramshard.layers.cpu_gemv.bind_swiglu_part`). None elsewhere: the caller runs
        :meth:`contribution`."""
        gate, up = w["gate_up_proj"].chunk(2, dim=0) if "gate_up_proj" in w else (w["gate_proj"], w["up_proj"])
        return cpu_gemv.bind_swiglu_part(h, gate, up, w["down_proj"], out)

    @staticmethod
    def work_elements(w: Mapping[str, torch.Tensor], rows: int) -> int:
        """Elements of :meth:`contribution_into`'s ``work`` for ``rows`` rows of the FFN (or pieces) ``w``."""
        gate_rows = w["gate_up_proj"].shape[0] if "gate_up_proj" in w else 2 * w["gate_proj"].shape[0]
        return rows * gate_rows

    def pieces_of(self, w: Mapping[str, torch.Tensor], first: int, last: int) -> dict[str, torch.Tensor]:
        """Views of pieces ``[first, last)`` in the whole-FFN weights ``w``: gate and up rows [r, D],
        down columns [D, r] (r: the pieces' rows)."""
        if not 0 <= first < last <= self.num_pieces:
            raise ValueError(f"pieces [{first}, {last}) of {self.name}, which has {self.num_pieces}")
        begin, end = self.bounds[first], self.bounds[last]
        if "gate_proj" in w:
            gate, up = w["gate_proj"], w["up_proj"]
        else:
            gate, up = w["gate_up_proj"].chunk(2, dim=0)
        return {"gate_proj": gate[begin:end], "up_proj": up[begin:end], "down_proj": w["down_proj"][:, begin:end]}

    def forward_pieces(self, w: Mapping[str, torch.Tensor], x: torch.Tensor, first: int, last: int) -> torch.Tensor:
        """The contribution of pieces ``[first, last)`` to the output for input ``x`` (norm included,
        residual not): ``x + sum of forward_pieces over a partition of the pieces == forward``."""
        return self.contribution(self.pieces_of(w, first, last), self.norm(w, x))
