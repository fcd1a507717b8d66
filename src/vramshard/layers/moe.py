"""``ffn[i]`` for Mixture-of-Experts models: pre-norm, router, routed SwiGLU experts, residual.

Every expert is its own placement piece (``expert.E``). The forward computes only the
experts that received tokens, grouping the tokens of each expert (no per-token loop).

Some architectures (Qwen2-MoE) add a shared expert that every token goes through, its
output scaled by the sigmoid of a one-row gate. It belongs to the ``main`` piece with the
norm and the router: every step reads it, so where a plan splits the layer at its experts
it stays in VRAM with the router (as llama.cpp's ``--cpu-moe`` keeps ``*_shexp`` on the GPU).

Expert weights reach the math through a small protocol, :class:`ExpertWeights`: a mapping
of the sub-layer's own weights (norm, router) with ``experts(ids)``, which yields the
weights of the asked experts, possibly lazily (copied into VRAM as they are asked for),
and ``stacked()``, all experts as two strided tensors where they lie at one stride (in VRAM,
or in the executor's host buffer). The executor supplies the source; a plain weight mapping
is wrapped in :class:`DictExperts`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, NamedTuple

import torch
import torch.nn.functional as F

from ..config import ModelArgs
from . import cpu_gemv, host_experts
from .mlp import swiglu, swiglu_fused
from .norm import rms_norm
from .step import Step
from .sublayer import Cost, SubLayer, WeightSpec, linear

# The gather path (no host synchronisation) copies each assignment's expert weights; used
# only while those copies stay below this many bytes (a decode step of a few tokens).
GATHER_BYTES = 96 * 2**20


@dataclass(frozen=True)
class ExpertNames:
    """How a checkpoint names the router, the three projections of expert E and a shared expert
    (the model files build their weights from it, the GGUF mapping its tensor names)."""

    block: str  # "mlp" (Qwen3-MoE) or "block_sparse_moe" (Mixtral)
    gate: str  # "gate_proj" or "w1"
    up: str  # "up_proj" or "w3"
    down: str  # "down_proj" or "w2"
    shared: str = "shared_expert"  # the shared expert's module in the block (its projections named as above)
    shared_gate: str = "shared_expert_gate"  # its one-row gate


QWEN_EXPERTS = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj")
MIXTRAL_EXPERTS = ExpertNames("block_sparse_moe", "w1", "w3", "w2")


@dataclass
class Routing:
    """Which experts each token goes to, and with what weight."""

    experts: torch.Tensor  # [T, k] int64
    weights: torch.Tensor  # [T, k] in the activation dtype

    def to(self, device: torch.device, non_blocking: bool = False) -> "Routing":
        return Routing(self.experts.to(device, non_blocking=non_blocking),
                       self.weights.to(device, non_blocking=non_blocking))


def _to_device(small: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device``. To a GPU it goes from pinned memory without waiting: a
    plain copy from pageable memory would block the host until the stream had done everything
    queued before it (here, the copies of the experts the cache was missing)."""
    if device.type != "cuda":
        return small.to(device)
    return small.pin_memory().to(device, non_blocking=True)


def _restricted(routing: Routing, only: set[int] | None) -> Routing:
    """``routing`` with the weight of every assignment to an expert outside ``only`` set to zero."""
    if only is None:
        return routing
    keep = torch.tensor([e in only for e in routing.experts.reshape(-1).tolist()], dtype=torch.bool)
    keep = _to_device(keep.view(routing.experts.shape), routing.weights.device)
    return Routing(routing.experts, routing.weights * keep)


class ExpertTensors(NamedTuple):
    """One expert's weights; ``gate_up`` [2F, D] is the free fused view of gate and up when
    they lie back to back (None otherwise)."""

    gate: torch.Tensor  # [F, D]
    up: torch.Tensor  # [F, D]
    down: torch.Tensor  # [D, F]
    gate_up: torch.Tensor | None = None


def _expert_swiglu(weights: ExpertTensors, h: torch.Tensor) -> torch.Tensor:
    """One expert on its tokens' hidden states ``h`` [n, D] → [n, D] (fused gate/up when it can)."""
    if weights.gate_up is not None:
        return swiglu_fused(h, weights.gate_up, weights.down)
    return swiglu(h, weights.gate, weights.up, weights.down)


class StackedExperts(NamedTuple):
    """All experts of a layer as strided tensors over one buffer (no copy)."""

    gate_up: torch.Tensor  # [E, 2F, D]
    down: torch.Tensor  # [E, D, F]


class Gathered(NamedTuple):
    """Experts held together for one step: ``stacked`` rows, ``rows[expert]`` the row of each
    expert asked for; ``release()`` once the work reading them is queued."""

    stacked: StackedExperts
    rows: dict[int, int]
    release: Callable[[], None]


class ExpertWeights(Mapping):
    """The weights of one MoE ``ffn[i]``: its own tensors by key, and its experts on demand."""

    def experts(self, ids: list[int]) -> Iterator[tuple[int, ExpertTensors]]:
        """(expert, weights) for every id in ``ids``, in an order of the source's choosing.

        The tensors of one item may be reused for another expert once the next item is
        asked for: the consumer must have queued all work on them by then.
        """
        raise NotImplementedError

    def stacked(self) -> StackedExperts | None:
        """All experts stacked, where the source holds them so (in VRAM, or a host buffer); else None."""
        return None

    def gather(self, ids: list[int]) -> Gathered | None:
        """The experts ``ids`` at once as rows of one stacked view, where the source can hold
        them together for a step (the VRAM expert cache); else None."""
        return None


class DictExperts(ExpertWeights):
    """Expert source over a plain ``{key: tensor}`` mapping holding every expert (host or VRAM).

    ``stack``: offer :meth:`stacked` when the experts lie at a uniform stride: on the GPU the
    gathered path then avoids a host synchronisation per layer; on the CPU a few half-precision
    tokens take one compiled pass (:mod:`~vramshard.layers.host_experts`), others the grouped path.
    """

    def __init__(self, weights: Mapping[str, torch.Tensor], num_experts: int, stack: bool = False):
        self.weights = weights
        self.num_experts = num_experts
        self._stacked = stack_experts(weights, num_experts) if stack else None

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.weights[key]

    def __iter__(self):
        return iter(self.weights)

    def __len__(self) -> int:
        return len(self.weights)

    def experts(self, ids: list[int]) -> Iterator[tuple[int, ExpertTensors]]:
        w = self.weights
        for e in ids:
            yield e, ExpertTensors(w[f"experts.{e}.gate"], w[f"experts.{e}.up"], w[f"experts.{e}.down"],
                                   w.get(f"experts.{e}.gate_up"))

    def stacked(self) -> StackedExperts | None:
        return self._stacked


def stack_experts(weights: Mapping[str, torch.Tensor], num_experts: int) -> StackedExperts | None:
    """Strided [E, ...] views over experts laid out at one stride in one buffer, or None."""
    if num_experts < 2 or any(f"experts.{e}.gate_up" not in weights for e in range(num_experts)):
        return None
    out = []
    for key in ("gate_up", "down"):
        parts = [weights[f"experts.{e}.{key}"] for e in range(num_experts)]
        first = parts[0]
        itemsize = first.element_size()
        stride_bytes = parts[1].data_ptr() - first.data_ptr()
        if stride_bytes <= 0 or stride_bytes % itemsize or not first.is_contiguous():
            return None
        if any(p.data_ptr() - first.data_ptr() != e * stride_bytes or p.shape != first.shape or not p.is_contiguous()
               for e, p in enumerate(parts)):
            return None
        out.append(first.as_strided((num_experts, *first.shape), (stride_bytes // itemsize, *first.stride())))
    return StackedExperts(*out)


class MoEFFN(SubLayer):
    kind = "ffn"

    def __init__(self, args: ModelArgs, layer: int, prefix: str, dtype: torch.dtype, names: ExpertNames):
        moe = args.moe
        assert moe is not None
        self.eps = args.rms_norm_eps
        self.num_experts, self.top_k, self.norm_topk_prob = moe.num_experts, moe.top_k, moe.norm_topk_prob
        d, f = args.hidden_size, moe.intermediate_size
        self.hidden, self.intermediate = d, f
        block = f"{prefix}.{names.block}"
        specs = [
            WeightSpec("post_attention_layernorm", f"{prefix}.post_attention_layernorm.weight", (d,), dtype),
            WeightSpec("router", f"{block}.gate.weight", (moe.num_experts, d), dtype),
        ]
        self.shared_intermediate = s = moe.shared_intermediate_size  # 0: no shared expert
        if s:  # in the main piece, right after the router (a piece's tensors lie together)
            shared = f"{block}.{names.shared}"
            specs += [
                WeightSpec("shared.gate", f"{shared}.{names.gate}.weight", (s, d), dtype),
                WeightSpec("shared.up", f"{shared}.{names.up}.weight", (s, d), dtype),
                WeightSpec("shared.down", f"{shared}.{names.down}.weight", (d, s), dtype),
            ]
        self.shared_gated = bool(s and moe.shared_gated)
        if self.shared_gated:
            specs.append(WeightSpec("shared.router", f"{block}.{names.shared_gate}.weight", (1, d), dtype))
        for e in range(moe.num_experts):
            piece = f"expert.{e}"
            specs += [
                WeightSpec(f"experts.{e}.gate", f"{block}.experts.{e}.{names.gate}.weight", (f, d), dtype, piece),
                WeightSpec(f"experts.{e}.up", f"{block}.experts.{e}.{names.up}.weight", (f, d), dtype, piece),
                WeightSpec(f"experts.{e}.down", f"{block}.experts.{e}.{names.down}.weight", (d, f), dtype, piece),
            ]
        super().__init__(f"ffn[{layer}]", layer, specs)
        # Gate and up of each expert lie back to back in a packed buffer: one fused matmul.
        self.fusable = {f"experts.{e}.gate_up": (f"experts.{e}.gate", f"experts.{e}.up")
                        for e in range(moe.num_experts)}
        if s:
            self.fusable["shared.gate_up"] = ("shared.gate", "shared.up")
        self.launches = 14 + (6 if s else 0)  # plus about 8 per expert that receives tokens (see matmuls)

    @property
    def expert_bytes(self) -> int:
        return 3 * self.hidden * self.intermediate * self.weights[0].dtype.itemsize

    @property
    def main_bytes(self) -> int:
        """Bytes of the sub-layer without its routed experts (norm, router, shared expert)."""
        return self.nbytes - self.num_experts * self.expert_bytes

    def expected_experts_touched(self, n_tokens: int) -> float:
        """Expected distinct experts hit by n tokens under uniform routing."""
        miss = (1 - self.top_k / self.num_experts) ** n_tokens
        return self.num_experts * (1 - miss)

    def main_matmuls(self, n_tokens: int) -> list[tuple[float, int, int]]:
        """The matmuls of the main piece: the router, and the shared expert where there is one."""
        out = [(n_tokens, self.hidden, self.num_experts)]
        if self.shared_intermediate:
            s = self.shared_intermediate
            out += [(n_tokens, self.hidden, 2 * s), (n_tokens, s, self.hidden)]
            if self.shared_gated:
                out.append((n_tokens, self.hidden, 1))
        return out

    def expert_matmuls(self, n_tokens: int) -> list[tuple[float, int, int]]:
        """The matmuls of the routed experts: two per expert hit, at its expected token count."""
        hit = self.expected_experts_touched(n_tokens)
        per_expert = n_tokens * self.top_k / hit  # expected tokens of each expert hit
        out: list[tuple[float, int, int]] = []
        for _ in range(round(hit)):
            out += [(per_expert, self.hidden, 2 * self.intermediate), (per_expert, self.intermediate, self.hidden)]
        return out

    def matmuls(self, n_tokens: int) -> list[tuple[float, int, int]]:
        return self.main_matmuls(n_tokens) + self.expert_matmuls(n_tokens)

    def cost(self, n_tokens: int, context: int) -> Cost:
        itemsize = self.weights[0].dtype.itemsize
        main_flops = sum(2 * m * k * n for m, k, n in self.main_matmuls(n_tokens))
        return Cost(
            flops=main_flops + 2 * n_tokens * self.top_k * 3 * self.hidden * self.intermediate,
            weight_bytes=self.main_bytes + self.expected_experts_touched(n_tokens) * self.expert_bytes,
            act_bytes=2 * n_tokens * self.hidden * itemsize,
        )

    # ------------------------------------------------------------------ forward, in two halves
    def route(self, w: Mapping[str, torch.Tensor], h: torch.Tensor) -> Routing:
        """Top-k experts of each token (ties: ``torch.topk`` order, as transformers)."""
        logits = linear(h, w["router"])  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_weights, top_experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
        return Routing(top_experts, top_weights.to(h.dtype))

    def prepare(self, w: Mapping[str, torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, Routing]:
        """First half: normed hidden states [T, D] and their routing (norm and router weights only)."""
        h = rms_norm(x, w["post_attention_layernorm"], self.eps)
        return h, self.route(w, h)

    def with_shared(self, w: Mapping[str, torch.Tensor], x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """``x`` plus the shared expert's output for the normed ``h`` [T, D] (``x`` itself without
        one): its SwiGLU, scaled by the sigmoid of its gate where the architecture has one (as
        transformers' Qwen2-MoE). Needs the main piece only."""
        if not self.shared_intermediate:
            return x
        if "shared.gate_up" in w:
            y = swiglu_fused(h, w["shared.gate_up"], w["shared.down"])
        else:
            y = swiglu(h, w["shared.gate"], w["shared.up"], w["shared.down"])
        if "shared.router" in w:
            y = torch.sigmoid(linear(h, w["shared.router"])) * y  # [T, 1] * [T, D]
        return x + y

    def forward(self, w: Mapping[str, torch.Tensor], x: torch.Tensor, step: Step) -> torch.Tensor:
        source = w if isinstance(w, ExpertWeights) else DictExperts(w, self.num_experts)
        h, routing = self.prepare(source, x)
        return self.with_shared(source, x, h) + self.run_experts(source, h, routing)

    def run_experts(self, source: ExpertWeights, h: torch.Tensor, routing: Routing,
                    only: set[int] | None = None) -> torch.Tensor:
        """Second half: the sum over each token's routed experts [T, D] (no residual).

        only: compute just the assignments to these experts (the others count zero), so the
        experts of one step can be split between sources (e.g. CPU and GPU) and the parts summed.
        """
        stacked = source.stacked()
        if stacked is not None and h.device.type == "cpu":  # a few CPU tokens in one C call or compiled pass
            keep = None if only is None else torch.isin(routing.experts, torch.tensor(sorted(only), dtype=torch.long))
            y = host_experts.routed(h, stacked.gate_up, stacked.down, routing.experts, routing.weights, keep)
            if y is not None:
                return y
        small = routing.experts.numel() * self.expert_bytes <= GATHER_BYTES
        if stacked is not None and small and h.device.type != "cpu":
            return self._run_gathered(stacked, h, _restricted(routing, only))
        if small:
            # A few tokens from a cache: all their experts at once, a handful of kernels for the
            # layer rather than several per expert (the host knows the experts: one sync).
            flat = routing.experts.reshape(-1).tolist()
            wanted = sorted({e for e in flat if only is None or e in only})
            if not wanted:
                return torch.zeros_like(h)
            gathered = source.gather(wanted)
            if gathered is not None:
                try:
                    # Assignments left out read any gathered row, with weight zero.
                    rows = torch.tensor([gathered.rows.get(e, gathered.rows[wanted[0]]) for e in flat])
                    rows = _to_device(rows.view(routing.experts.shape), h.device)
                    return self._run_gathered(gathered.stacked, h, Routing(rows, _restricted(routing, only).weights))
                finally:
                    gathered.release()
        if h.shape[0] == 1 and h.device.type == "cpu":
            return self._run_one_token_on_host(source, h, routing, only)
        return self._run_grouped(source, h, routing, only)

    def experts_part(self, source: ExpertWeights, h: torch.Tensor, routing: Routing,
                     out: torch.Tensor) -> cpu_gemv.BoundPart | None:
        """:meth:`run_experts` (every assignment) into ``out`` [T, D] as one bound C call, where run_experts
        would compute it with the C kernel (host memory, the stacked experts): the run-ahead worker runs it
        with its inputs' values still on their way (:func:`~vramshard.layers.host_experts.routed_part`).
        None elsewhere: the caller runs :meth:`run_experts`."""
        stacked = source.stacked()
        if stacked is None or h.device.type != "cpu":
            return None
        return host_experts.routed_part(h, stacked.gate_up, stacked.down, routing.experts, routing.weights, out)

    def _run_one_token_on_host(self, source: ExpertWeights, h: torch.Tensor, routing: Routing,
                               only: set[int] | None = None) -> torch.Tensor:
        """One token on the CPU: each routed expert's SwiGLU, accumulated with its routing weight.

        The grouped path's sort, per-expert token gathers and scatter-adds cost ~50 µs an expert
        on the GPU machine's host, as much as a small expert's matmuls; one token needs none of them.
        """
        experts = routing.experts[0].tolist()
        weight_of = dict(zip(experts, routing.weights[0].float().tolist()))
        out = torch.zeros_like(h)
        for expert, weights in source.experts([e for e in experts if only is None or e in only]):
            out.add_(_expert_swiglu(weights, h), alpha=weight_of[expert])
        return out

    def _run_grouped(self, source: ExpertWeights, h: torch.Tensor, routing: Routing,
                     only: set[int] | None = None) -> torch.Tensor:
        """Each hit expert once, on all its tokens: one (fused) matmul pair per hit expert."""
        flat_experts = routing.experts.reshape(-1)  # [T*k]
        order = torch.argsort(flat_experts, stable=True)
        counts = torch.bincount(flat_experts, minlength=self.num_experts).tolist()  # host sync: which experts
        counts_used = counts if only is None else [c if e in only else 0 for e, c in enumerate(counts)]
        begins, cursor = {}, 0
        for expert, count in enumerate(counts):
            begins[expert] = cursor
            cursor += count
        token_of = order // routing.experts.shape[1]  # token index of each sorted assignment (k assignments a token)
        weight_of = routing.weights.reshape(-1)[order]
        out = torch.zeros_like(h)
        hit = [e for e, c in enumerate(counts_used) if c]
        for expert, weights in source.experts(hit):
            begin, count = begins[expert], counts[expert]
            tokens = token_of[begin : begin + count]
            y = _expert_swiglu(weights, h[tokens])
            out.index_add_(0, tokens, y * weight_of[begin : begin + count, None])
        return out

    def _run_gathered(self, stacked: StackedExperts, h: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Few tokens, experts resident: gather each assignment's expert and batch the matmuls,
        with no host synchronisation."""
        T, k = routing.experts.shape
        flat = routing.experts.reshape(-1)  # [A], A = T*k, token-major
        hx = h.repeat_interleave(k, dim=0)[:, :, None]  # [A, D, 1]
        gate, up = torch.bmm(stacked.gate_up[flat], hx).squeeze(-1).chunk(2, dim=-1)  # [A, F] each
        act = (F.silu(gate) * up)[:, :, None]  # [A, F, 1]
        y = torch.bmm(stacked.down[flat], act).squeeze(-1)  # [A, D]
        return (y.view(T, k, -1) * routing.weights[:, :, None]).sum(dim=1)
