"""Images for Qwen2-VL-family models: decode, resize to the patch grid, normalize, patchify.

Produces exactly the ``pixel_values`` [patches, C*T*P*P] and ``image_grid_thw`` [images, 3]
tensors of the Hugging Face ``Qwen2VLImageProcessor`` (PIL backend), and expands the
prompt's image placeholders (``<|vision_start|><|image_pad|><|vision_end|>``) to one pad
token per image embedding.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, Union

import numpy as np
import torch

from ..errors import InvalidInputError, ModelLoadError

IMAGE_PAD = "<|image_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PLACEHOLDER = f"{VISION_START}{IMAGE_PAD}{VISION_END}"
MAX_ASPECT_RATIO = 200
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

ImageSource = Union[str, Path, bytes, "PIL.Image.Image"]  # noqa: F821


@dataclass(frozen=True)
class ImageConfig:
    """Preprocessing settings (``preprocessor_config.json`` names; defaults: Qwen2.5-VL's)."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255

    @property
    def factor(self) -> int:
        """Image sides are multiples of this many pixels (one merge group)."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, data: dict) -> "ImageConfig":
        size = data.get("size") or {}
        d = cls()
        return cls(
            patch_size=int(data.get("patch_size", d.patch_size)),
            temporal_patch_size=int(data.get("temporal_patch_size", d.temporal_patch_size)),
            merge_size=int(data.get("merge_size", d.merge_size)),
            min_pixels=int(data.get("min_pixels") or size.get("shortest_edge") or d.min_pixels),
            max_pixels=int(data.get("max_pixels") or size.get("longest_edge") or d.max_pixels),
            image_mean=tuple(float(v) for v in data.get("image_mean") or d.image_mean),
            image_std=tuple(float(v) for v in data.get("image_std") or d.image_std),
            rescale_factor=float(data.get("rescale_factor", d.rescale_factor)),
        )

    @classmethod
    def from_dir(cls, path: str | Path, **overrides) -> "ImageConfig":
        """Read ``preprocessor_config.json`` of a model directory (defaults when it has none)."""
        file = Path(path) / "preprocessor_config.json"
        data = {}
        if file.is_file():
            try:
                data = json.loads(file.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ModelLoadError(f"{file} is not valid JSON: {exc}") from None
        data.update(overrides)
        return cls.from_dict(data)


@dataclass
class ImageInputs:
    """What the vision encoder takes: patches and the grid of each image."""

    pixel_values: torch.Tensor  # float32 [patches, C * T * P * P]
    image_grid_thw: torch.Tensor  # int64 [images, 3]

    def tokens_per_image(self, merge_size: int) -> list[int]:
        return [int(t * h * w) // (merge_size * merge_size) for t, h, w in self.image_grid_thw.tolist()]


def load_image(source: ImageSource):
    """A PIL image in RGB from a path, encoded bytes or a PIL image; transparency goes onto white."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(source, Image.Image):
        image = source
    else:
        what = "image bytes" if isinstance(source, (bytes, bytearray)) else repr(str(source))
        try:
            if isinstance(source, (bytes, bytearray)):
                image = Image.open(io.BytesIO(source))
            else:
                image = Image.open(Path(source).expanduser())
            image.load()
        except FileNotFoundError:
            raise InvalidInputError(f"image file {what} does not exist") from None
        except UnidentifiedImageError:
            raise InvalidInputError(f"{what} is not an image in a format Pillow can read (PNG, JPEG, WebP, "
                                    "GIF, BMP, TIFF, ...)") from None
        except (OSError, ValueError, Image.DecompressionBombError) as exc:
            raise InvalidInputError(f"cannot read image {what}: {exc}") from None
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 28 * 28 * 1280) -> tuple[int, int]:
    """The size closest to (height, width) with sides multiples of ``factor`` and area within the limits."""
    if min(height, width) <= 0:
        raise InvalidInputError(f"image of size {width}x{height} is empty")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise InvalidInputError(f"image of size {width}x{height}: aspect ratio must be below {MAX_ASPECT_RATIO}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def preprocess_image(image, config: ImageConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """One RGB PIL image → patches [grid_h * grid_w, C*T*P*P] float32 and its grid (1, grid_h, grid_w)."""
    from PIL import Image

    height, width = image.height, image.width
    new_h, new_w = smart_resize(height, width, config.factor, config.min_pixels, config.max_pixels)
    resized = np.array(image.resize((new_w, new_h), resample=Image.Resampling.BICUBIC))  # [H, W, C] uint8
    # The same arithmetic as the reference: rescale in float64, then normalize in float32.
    pixels = (resized.astype(np.float64) * config.rescale_factor).astype(np.float32)
    mean = np.array(config.image_mean, dtype=np.float32)
    std = np.array(config.image_std, dtype=np.float32)
    pixels = ((pixels - mean) / std).transpose(2, 0, 1)  # [C, H, W]
    return _patchify(pixels, config), (1, new_h // config.patch_size, new_w // config.patch_size)


def _patchify(image: np.ndarray, config: ImageConfig) -> np.ndarray:
    """[C, H, W] → [grid_h * grid_w, C * T * P * P], patches merge-group by merge-group, the frame
    repeated ``temporal_patch_size`` times (a still image is a clip of identical frames)."""
    channels, height, width = image.shape
    p, m, t = config.patch_size, config.merge_size, config.temporal_patch_size
    gh, gw = height // p, width // p
    patches = image.reshape(channels, gh // m, m, p, gw // m, m, p)
    patches = patches.transpose(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, C, p, p]
    patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], t, p, p))
    return patches.reshape(gh * gw, channels * t * p * p)


def preprocess_images(images: Sequence[ImageSource], config: ImageConfig | None = None) -> ImageInputs:
    """Images (paths, bytes or PIL images) → the ``pixel_values`` / ``image_grid_thw`` of the HF processor."""
    config = config or ImageConfig()
    if not images:
        raise InvalidInputError("no images given")
    patches, grids = [], []
    for source in images:
        flat, grid = preprocess_image(load_image(source), config)
        patches.append(flat)
        grids.append(grid)
    return ImageInputs(torch.from_numpy(np.concatenate(patches, axis=0)), torch.tensor(grids, dtype=torch.long))


def expand_image_tokens(ids: Sequence[int], image_token_id: int, tokens_per_image: Sequence[int]) -> list[int]:
    """Repeat the i-th image pad token of ``ids`` ``tokens_per_image[i]`` times (one per image embedding)."""
    pads = sum(1 for t in ids if t == image_token_id)
    if pads != len(tokens_per_image):
        raise InvalidInputError(f"the prompt has {pads} image placeholder(s) but {len(tokens_per_image)} image(s) "
                                f"were given; put one {IMAGE_PLACEHOLDER} in the prompt per image")
    out, image = [], 0
    for t in ids:
        if t == image_token_id:
            out.extend([image_token_id] * tokens_per_image[image])
            image += 1
        else:
            out.append(t)
    return out


def expand_image_text(text: str, tokens_per_image: Sequence[int], pad: str = IMAGE_PAD) -> str:
    """The same on prompt text: the i-th ``pad`` string becomes ``tokens_per_image[i]`` copies."""
    parts = text.split(pad)
    if len(parts) - 1 != len(tokens_per_image):
        raise InvalidInputError(f"the prompt has {len(parts) - 1} image placeholder(s) but {len(tokens_per_image)} "
                                f"image(s) were given; put one {IMAGE_PLACEHOLDER} in the prompt per image")
    out = [parts[0]]
    for count, rest in zip(tokens_per_image, parts[1:]):
        out.append(pad * count + rest)
    return "".join(out)


def decode_data_url(url: str) -> bytes:
    """The bytes of a base64 ``data:image/...;base64,...`` URL (remote URLs are not fetched)."""
    import base64
    import binascii

    if not url.startswith("data:"):
        raise InvalidInputError(f"image URL {url[:60]!r} is not a data URL; send the image inline as "
                                "data:image/png;base64,... (vramshard fetches nothing over the network)")
    header, _, data = url.partition(",")
    if not header.endswith(";base64"):
        raise InvalidInputError("an image data URL must be base64-encoded (data:image/png;base64,...)")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInputError("an image data URL holds invalid base64") from None
