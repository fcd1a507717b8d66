"""Qwen2.5-VL (and Cosmos-Reason1, the same architecture): vision encoder + Qwen2 language model.

Sub-layers, in run order: ``vision.patch_embed``, ``vision.block[i]``, ``vision.merger``
(the vision phase, run once per prompt with images), then ``embed`` (which also places
the image embeddings), ``attn[i]`` / ``ffn[i]`` (Qwen2: q/k/v bias, multimodal rotary)
and ``head``. Checkpoint names are those of the Hugging Face checkpoints
(``model.layers.*``, ``visual.*``, ``lm_head.*``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from ..config import ModelArgs
from ..errors import ModelLoadError
from ..layers.embedding import Embedding
from ..layers.step import Step
from ..layers.vision import VisionArgs, vision_encoder
from .base import Model
from .decoder import decoder_model

ARCHITECTURES = ("Qwen2_5_VLForConditionalGeneration",)
VISION_PREFIX = "visual"
DEFAULT_TEXT_THETA = 1000000.0  # Qwen2.5-VL text rope base when config.json does not say


@dataclass(frozen=True)
class Qwen2_5_VLArgs(ModelArgs):
    """Language-model args plus the vision encoder, multimodal rotary sections and special tokens."""

    vision: VisionArgs = VisionArgs()
    mrope_section: tuple[int, ...] = (16, 24, 24)
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653

    def validate(self) -> None:
        super().validate()
        if sum(self.mrope_section) * 2 != self.head_dim:
            raise ModelLoadError(
                f"config.json: mrope_section {list(self.mrope_section)} must sum to head_dim / 2 = {self.head_dim // 2}"
            )
        v = self.vision
        if v.hidden_size % v.num_heads or (v.hidden_size // v.num_heads) % 4:
            raise ModelLoadError(f"vision_config: hidden_size {v.hidden_size} must split into {v.num_heads} heads "
                                 "whose size is a multiple of 4 (2-D rotary)")
        if v.window_groups <= 0:
            raise ModelLoadError(f"vision_config: window_size {v.window_size} is smaller than one merge group "
                                 f"({v.spatial_merge_size * v.patch_size} pixels)")


def model_args(config: dict) -> Qwen2_5_VLArgs:
    """Text fields may sit at the top level (older files) or under ``text_config`` (transformers >= 4.5x)."""
    text = {k: v for k, v in config.items() if k not in ("text_config", "vision_config")}
    text.update(config.get("text_config") or {})
    text["architectures"] = config.get("architectures") or text.get("architectures")
    # Rope: "mrope" is ordinary rotary plus the sections; keep the sections apart.
    rope = dict(text.get("rope_scaling") or {})
    rope.update(text.get("rope_parameters") or {})
    section = tuple(int(s) for s in rope.pop("mrope_section", None) or (16, 24, 24))
    if rope.get("rope_type", rope.get("type")) in ("mrope", None):
        rope["rope_type"] = "default"
    rope.pop("type", None)
    rope.setdefault("rope_theta", text.get("rope_theta", DEFAULT_TEXT_THETA))
    text["rope_parameters"], text["rope_scaling"] = rope, None
    specials = {k: int(config[k]) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                            "vision_end_token_id") if config.get(k) is not None}
    return Qwen2_5_VLArgs.from_config(text, attention_bias=True, mrope_section=section,
                                      vision=vision_args(config.get("vision_config") or {}), **specials)


def vision_args(config: dict) -> VisionArgs:
    """A ``vision_config`` dict → :class:`VisionArgs` (defaults: the reference's)."""
    d = VisionArgs()
    rope = config.get("rope_parameters") or {}
    try:
        return VisionArgs(
            depth=int(config.get("depth", d.depth)),
            hidden_size=int(config.get("hidden_size", d.hidden_size)),
            intermediate_size=int(config.get("intermediate_size", d.intermediate_size)),
            num_heads=int(config.get("num_heads", d.num_heads)),
            in_channels=int(config.get("in_channels", config.get("in_chans", d.in_channels))),
            patch_size=int(config.get("patch_size", d.patch_size)),
            temporal_patch_size=int(config.get("temporal_patch_size", d.temporal_patch_size)),
            spatial_merge_size=int(config.get("spatial_merge_size", d.spatial_merge_size)),
            window_size=int(config.get("window_size", d.window_size)),
            out_hidden_size=int(config.get("out_hidden_size", d.out_hidden_size)),
            fullatt_block_indexes=tuple(int(i) for i in config.get("fullatt_block_indexes", d.fullatt_block_indexes)),
            hidden_act=str(config.get("hidden_act", d.hidden_act)),
            tokens_per_second=float(config.get("tokens_per_second", d.tokens_per_second)),
            rope_theta=float(rope.get("rope_theta", d.rope_theta)),
        )
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"config.json: vision_config has a value of the wrong type: {exc}") from None


class MultimodalEmbedding(Embedding):
    """``embed``: token embeddings, with the rows of image placeholder tokens replaced by image embeddings
    (``step.input_embeds``, made by the vision phase)."""

    def forward(self, w: Mapping[str, torch.Tensor], x: torch.Tensor, step: Step) -> torch.Tensor:
        h = super().forward(w, x, step)  # [T, D], a fresh tensor (gather)
        if step.input_embeds is not None:
            rows, vectors = step.input_embeds
            h[rows.to(h.device)] = vectors.to(h.device, h.dtype)
        return h


def build(args: Qwen2_5_VLArgs, dtype: torch.dtype) -> Model:
    text = decoder_model(args, dtype)
    assert isinstance(text.sublayers[0], Embedding)
    sublayers = vision_encoder(args.vision, VISION_PREFIX, dtype) + [MultimodalEmbedding(args, dtype)]
    return Model(args, sublayers + text.sublayers[1:], dtype)
