"""Vision encoder sub-layers of the Qwen2-VL family: ``vision.patch_embed``, ``vision.block[i]``, ``vision.merger``.

The encoder turns the patches of one or more images ([N, C*T*P*P], as the image
processor makes them) into one embedding per ``merge x merge`` group of patches
([N / merge^2, out_hidden]), which replace the image placeholder tokens of the prompt.

Patches are processed in *window order*: ``patch_embed`` permutes them so every
attention window is a contiguous run of rows, the blocks attend inside windows (or,
for the blocks listed in ``fullatt_block_indexes``, inside whole images) and
``merger`` restores the original order. Attention is block-diagonal: it is computed
per segment with fused ``scaled_dot_product_attention`` (segments of equal length
batched together), never as one N x N score matrix, and long segments are tiled over
queries so even a fallback kernel materializes at most ``max_score_bytes`` of scores.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch
import torch.nn.functional as F

from .norm import rms_norm
from .rotary import apply_rotary_float32, axial_cos_sin, axial_inverse_frequencies
from .sublayer import Cost, SubLayer, WeightSpec, linear

VISION_KIND = "vision"
VISION_EPS = 1e-6  # the encoder's RMSNorm epsilon (fixed in the reference implementation)
SCORE_BYTES = 256 * 2**20  # default cap on the attention scores of one kernel call

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


@dataclass(frozen=True)
class VisionArgs:
    """Hyper-parameters of a Qwen2.5-VL vision encoder (field names as in ``vision_config``)."""

    depth: int = 32
    hidden_size: int = 1280
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112  # pixels
    out_hidden_size: int = 3584
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    hidden_act: str = "silu"
    tokens_per_second: float = 4.0
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per flattened patch: C * T * P * P."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size**2

    @property
    def window_groups(self) -> int:
        """Side of an attention window, in merge groups."""
        return self.window_size // self.spatial_merge_size // self.patch_size


@dataclass
class VisionStep:
    """The layout of one vision-encoder pass over images with grids ``grid_thw`` ([t, h, w] in patches).

    Derives (once, then per device on demand) the window permutation, the 2-D rotary
    tables and the attention segments. ``tile_queries`` switches query tiling of long
    segments on or off (off: one kernel call per group of segments, for measuring);
    ``mlp_rows`` bounds the MLP's intermediate activations the same way.
    """

    grid_thw: list[tuple[int, int, int]]
    args: VisionArgs
    tile_queries: bool = True
    max_score_bytes: int = SCORE_BYTES
    mlp_rows: int | None = None  # run the blocks' MLP over row chunks of this size (None: all rows at once)
    _memo: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self.grid_thw = [tuple(int(v) for v in g) for g in self.grid_thw]
        merge = self.args.spatial_merge_size
        for t, h, w in self.grid_thw:
            if min(t, h, w) <= 0 or h % merge or w % merge:
                raise ValueError(f"image grid {t}x{h}x{w} must be positive with h and w multiples of {merge}")
        self.window_index, window_lengths = _window_layout(self.grid_thw, merge, self.args.window_groups)
        self.num_patches = sum(t * h * w for t, h, w in self.grid_thw)
        unit = self.args.merge_unit
        self.window_lengths = [n * unit for n in window_lengths]
        self.image_lengths = [h * w for t, h, w in self.grid_thw for _ in range(t)]  # one segment per frame

    @property
    def num_merged(self) -> int:
        """Embeddings the encoder outputs: one per merge group."""
        return self.num_patches // self.args.merge_unit

    def memo(self, key, device: torch.device, build: Callable[[], object]):
        full_key = (key, str(device))
        if full_key not in self._memo:
            self._memo[full_key] = build()
        return self._memo[full_key]

    def window_order(self, device: torch.device) -> torch.Tensor:
        """Merge-group permutation into window order [N / merge^2] (int64)."""
        return self.memo("window_index", device, lambda: self.window_index.to(device))

    def original_order(self, device: torch.device) -> torch.Tensor:
        return self.memo("reverse_index", device, lambda: torch.argsort(self.window_index).to(device))

    def rotary(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 cos, sin [N, head_dim] of every patch, in window order."""
        def build():
            positions = _patch_positions(self.grid_thw, self.args.spatial_merge_size)  # [N, 2]
            unit = self.args.merge_unit
            positions = positions.view(-1, unit, 2)[self.window_index].reshape(-1, 2)
            inv_freq = axial_inverse_frequencies(self.args.rope_theta, self.args.head_dim)
            return tuple(t.to(device) for t in axial_cos_sin(inv_freq, positions))

        return self.memo("rotary", device, build)

    def segments(self, full: bool, device: torch.device) -> list[torch.Tensor]:
        """Attention segments grouped by length: row-index tensors [n, L] (segments of length L)."""
        lengths = self.image_lengths if full else self.window_lengths
        return self.memo(("segments", full), device, lambda: [g.to(device) for g in _group_segments(lengths)])


def _patch_positions(grid_thw: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """(row, column) of every patch [N, 2], patches listed merge-block by merge-block."""
    out = []
    for t, h, w in grid_thw:
        rows = torch.arange(h)[:, None].expand(h, w)
        cols = torch.arange(w)[None, :].expand(h, w)
        block = (h // merge, merge, w // merge, merge)
        rows = rows.reshape(block).transpose(1, 2).flatten()
        cols = cols.reshape(block).transpose(1, 2).flatten()
        out.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(out)


def _window_layout(grid_thw: list[tuple[int, int, int]], merge: int, side: int) -> tuple[torch.Tensor, list[int]]:
    """Window order of the merge groups [G] and the length (in groups) of each non-empty window.

    Each frame's grid of merge groups is cut into ``side x side`` windows (the last row and
    column of windows may be partial); windows are listed row-major, groups inside a window
    row-major.
    """
    order, lengths, offset = [], [], 0
    for t, h, w in grid_thw:
        gh, gw = h // merge, w // merge
        index = torch.arange(t * gh * gw).reshape(t, gh, gw)
        pad_h, pad_w = -gh % side, -gw % side
        padded = F.pad(index, (0, pad_w, 0, pad_h), value=-1)
        nh, nw = (gh + pad_h) // side, (gw + pad_w) // side
        windows = padded.reshape(t, nh, side, nw, side).permute(0, 1, 3, 2, 4).reshape(-1, side * side)
        for window in windows:
            kept = window[window >= 0]
            if kept.numel():
                order.append(kept + offset)
                lengths.append(kept.numel())
        offset += t * gh * gw
    return torch.cat(order), lengths


def _group_segments(lengths: list[int]) -> list[torch.Tensor]:
    starts, cursor = [], 0
    for n in lengths:
        starts.append(cursor)
        cursor += n
    by_length: dict[int, list[int]] = {}
    for start, n in zip(starts, lengths):
        by_length.setdefault(n, []).append(start)
    return [torch.tensor(s)[:, None] + torch.arange(n)[None, :] for n, s in by_length.items()]  # [n_seg, L]


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: list[torch.Tensor],
                      tile_queries: bool = True, max_score_bytes: int = SCORE_BYTES) -> torch.Tensor:
    """Block-diagonal attention: q, k, v [N, H, D]; each token attends within its segment.

    segments: row indices [n, L] of the segments of length L (see :meth:`VisionStep.segments`).
    Returns [N, H, D]. Segments of one length share one fused kernel call (or, tiled, a few).
    """
    if len(segments) == 1 and segments[0].shape[0] == 1:  # one segment: no gather
        out = _tiled_sdpa(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                          tile_queries, max_score_bytes)
        return out[0].transpose(0, 1)
    out = torch.empty_like(q)
    for rows in segments:
        part = [t[rows].transpose(1, 2) for t in (q, k, v)]  # [n, H, L, D]
        out[rows] = _tiled_sdpa(*part, tile_queries, max_score_bytes).transpose(1, 2)
    return out


def _tiled_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tile_queries: bool,
                max_score_bytes: int) -> torch.Tensor:
    """SDPA over [n, H, L, D]; with ``tile_queries``, in query tiles whose scores stay under the cap."""
    n, heads, length, _ = q.shape
    tile = max(1, max_score_bytes // (n * heads * length * 4))
    if not tile_queries or tile >= length:
        return F.scaled_dot_product_attention(q, k, v)
    return torch.cat([F.scaled_dot_product_attention(q[:, :, s : s + tile], k, v)
                      for s in range(0, length, tile)], dim=2)


class PatchEmbed(SubLayer):
    """``vision.patch_embed``: the 3-D convolution over (t, p, p) patches, as one matmul, then window order."""

    kind = VISION_KIND
    launches = 3

    def __init__(self, args: VisionArgs, prefix: str, dtype: torch.dtype):
        self.args = args
        shape = (args.hidden_size, args.in_channels, args.temporal_patch_size, args.patch_size, args.patch_size)
        super().__init__("vision.patch_embed", None, [WeightSpec("proj", f"{prefix}.patch_embed.proj.weight", shape, dtype)])

    def matmuls(self, n_tokens: int) -> list[tuple[float, int, int]]:
        return [(n_tokens, self.args.patch_dim, self.args.hidden_size)]

    def cost(self, n_tokens: int, context: int) -> Cost:
        item = self.weights[0].dtype.itemsize
        return Cost(flops=2 * n_tokens * self.args.patch_dim * self.args.hidden_size, weight_bytes=self.nbytes,
                    act_bytes=n_tokens * (self.args.patch_dim * 4 + self.args.hidden_size * item))

    def forward(self, w: Mapping[str, torch.Tensor], x: torch.Tensor, step: VisionStep) -> torch.Tensor:
        """Patches [N, C*T*P*P] → hidden states [N, D] in window order."""
        weight = w["proj"]
        h = linear(x.to(weight.dtype), weight.reshape(weight.shape[0], -1))  # [N, D]
        unit = self.args.merge_unit
        return h.view(-1, unit, h.shape[-1])[step.window_order(h.device)].reshape(h.shape)


class VisionBlock(SubLayer):
    """``vision.block[i]``: RMSNorm, attention with 2-D rotary (windowed or full), RMSNorm, SwiGLU MLP."""

    kind = VISION_KIND
    launches = 24

    def __init__(self, args: VisionArgs, index: int, prefix: str, dtype: torch.dtype):
        self.args = args
        self.index = index
        self.full_attention = index in args.fullatt_block_indexes
        if args.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"vision hidden_act {args.hidden_act!r} is not supported; supported: "
                             f"{', '.join(sorted(_ACTIVATIONS))}")
        self.act = _ACTIVATIONS[args.hidden_act]
        d, f = args.hidden_size, args.intermediate_size
        p = f"{prefix}.blocks.{index}"
        super().__init__(f"vision.block[{index}]", None, [
            WeightSpec("norm1", f"{p}.norm1.weight", (d,), dtype),
            WeightSpec("qkv", f"{p}.attn.qkv.weight", (3 * d, d), dtype),
            WeightSpec("qkv_bias", f"{p}.attn.qkv.bias", (3 * d,), dtype),
            WeightSpec("proj", f"{p}.attn.proj.weight", (d, d), dtype),
            WeightSpec("proj_bias", f"{p}.attn.proj.bias", (d,), dtype),
            WeightSpec("norm2", f"{p}.norm2.weight", (d,), dtype),
            WeightSpec("gate_proj", f"{p}.mlp.gate_proj.weight", (f, d), dtype),
            WeightSpec("gate_bias", f"{p}.mlp.gate_proj.bias", (f,), dtype),
            WeightSpec("up_proj", f"{p}.mlp.up_proj.weight", (f, d), dtype),
            WeightSpec("up_bias", f"{p}.mlp.up_proj.bias", (f,), dtype),
            WeightSpec("down_proj", f"{p}.mlp.down_proj.weight", (d, f), dtype),
            WeightSpec("down_bias", f"{p}.mlp.down_proj.bias", (d,), dtype),
        ])

    def matmuls(self, n_tokens: int) -> list[tuple[float, int, int]]:
        d, f = self.args.hidden_size, self.args.intermediate_size
        return [(n_tokens, d, 3 * d), (n_tokens, d, d), (n_tokens, d, 2 * f), (n_tokens, f, d)]

    def cost(self, n_tokens: int, context: int) -> Cost:
        """n_tokens: patches; attention spans the whole input (full blocks) or one window."""
        d, f = self.args.hidden_size, self.args.intermediate_size
        window = (self.args.window_groups**2) * self.args.merge_unit
        span = n_tokens if self.full_attention else min(n_tokens, window)
        item = self.weights[0].dtype.itemsize
        return Cost(flops=2 * n_tokens * (4 * d * d + 3 * d * f) + 4 * n_tokens * span * d,
                    weight_bytes=self.nbytes, act_bytes=2 * n_tokens * d * item)

    def forward(self, w: Mapping[str, torch.Tensor], x: torch.Tensor, step: VisionStep) -> torch.Tensor:
        N, d = x.shape
        heads = self.args.num_heads
        # The normed input is not kept: it is freed as soon as the projection has read it.
        qkv = linear(rms_norm(x, w["norm1"], VISION_EPS), w["qkv"], w["qkv_bias"])  # [N, 3 * D]
        q, k, v = qkv.view(N, 3, heads, -1).unbind(1)  # each [N, H, Dh]
        cos, sin = step.rotary(x.device)
        # Rotary in float32, as the reference does, then back to the compute dtype (row chunks:
        # the float32 temporaries of a large image would otherwise be the phase's peak).
        q = apply_rotary_float32(q, cos, sin)
        k = apply_rotary_float32(k, cos, sin)
        v = v.contiguous()  # q, k, v no longer view the projection: its [N, 3 * D] is freed
        del qkv
        out = segment_attention(q, k, v, step.segments(self.full_attention, x.device),
                                step.tile_queries, step.max_score_bytes)  # [N, H, Dh]
        x = x + linear(out.reshape(N, d), w["proj"], w["proj_bias"])
        del q, k, v, out
        rows = step.mlp_rows or N
        if rows >= N:
            return x + self._mlp(w, x)
        for begin in range(0, N, rows):  # the MLP is per row: chunks bound its [rows, F] intermediates
            x[begin : begin + rows] += self._mlp(w, x[begin : begin + rows])
        return x

    def _mlp(self, w: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        h = rms_norm(x, w["norm2"], VISION_EPS)
        gated = self.act(linear(h, w["gate_proj"], w["gate_bias"])) * linear(h, w["up_proj"], w["up_bias"])
        return linear(gated, w["down_proj"], w["down_bias"])


class PatchMerger(SubLayer):
    """``vision.merger``: RMSNorm, then each merge group of patches → one LM embedding (MLP), original order."""

    kind = VISION_KIND
    launches = 8

    def __init__(self, args: VisionArgs, prefix: str, dtype: torch.dtype):
        self.args = args
        d, m, out = args.hidden_size, args.hidden_size * args.merge_unit, args.out_hidden_size
        p = f"{prefix}.merger"
        super().__init__("vision.merger", None, [
            WeightSpec("ln_q", f"{p}.ln_q.weight", (d,), dtype),
            WeightSpec("fc1", f"{p}.mlp.0.weight", (m, m), dtype),
            WeightSpec("fc1_bias", f"{p}.mlp.0.bias", (m,), dtype),
            WeightSpec("fc2", f"{p}.mlp.2.weight", (out, m), dtype),
            WeightSpec("fc2_bias", f"{p}.mlp.2.bias", (out,), dtype),
        ])

    def matmuls(self, n_tokens: int) -> list[tuple[float, int, int]]:
        m = self.args.hidden_size * self.args.merge_unit
        groups = n_tokens / self.args.merge_unit
        return [(groups, m, m), (groups, m, self.args.out_hidden_size)]

    def cost(self, n_tokens: int, context: int) -> Cost:
        m = self.args.hidden_size * self.args.merge_unit
        groups = n_tokens / self.args.merge_unit
        item = self.weights[0].dtype.itemsize
        return Cost(flops=2 * groups * m * (m + self.args.out_hidden_size), weight_bytes=self.nbytes,
                    act_bytes=groups * (m + self.args.out_hidden_size) * item)

    def forward(self, w: Mapping[str, torch.Tensor], x: torch.Tensor, step: VisionStep) -> torch.Tensor:
        """Hidden states [N, D] (window order) → image embeddings [N / merge^2, out_hidden] (original order)."""
        h = rms_norm(x, w["ln_q"], VISION_EPS).view(-1, self.args.hidden_size * self.args.merge_unit)
        h = linear(F.gelu(linear(h, w["fc1"], w["fc1_bias"])), w["fc2"], w["fc2_bias"])
        return h[step.original_order(h.device)]


def vision_encoder(args: VisionArgs, prefix: str, dtype: torch.dtype) -> list[SubLayer]:
    """``vision.patch_embed, vision.block[0..depth-1], vision.merger`` with weights under ``prefix``."""
    return ([PatchEmbed(args, prefix, dtype)]
            + [VisionBlock(args, i, prefix, dtype) for i in range(args.depth)]
            + [PatchMerger(args, prefix, dtype)])
