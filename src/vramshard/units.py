"""Parsing and printing byte sizes such as ``4GiB``, ``2048MiB`` or ``1.5GB``."""

import re

from .errors import InvalidInputError

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int | float) -> int:
    """Bytes from ``"4GiB"``, ``"2048MiB"``, ``"1.5GB"`` or a plain number of bytes."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text < 0:
            raise InvalidInputError(f"size must not be negative, got {text}")
        return int(text)
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise InvalidInputError(
            f"cannot read size {text!r}: use a number with a unit such as 4GiB, 2048MiB or 1.5GB"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(n: float) -> str:
    """Human-readable binary size: ``format_bytes(3 * 2**30) == '3.00 GiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


AUTO = "auto"  # --vram auto: the free VRAM less a safety margin
AUTO_MARGIN_BYTES = 512 * 2**20  # at least this much VRAM is left for the display, other programs, drivers
AUTO_MARGIN_FRACTION = 0.05  # ... or this fraction of the GPU's memory, whichever is more


def is_auto(text) -> bool:
    """Whether a ``--vram`` value asks for the automatic budget."""
    return isinstance(text, str) and text.strip().lower() == AUTO


def auto_margin(total_bytes: int) -> int:
    """VRAM ``--vram auto`` leaves free on a GPU of ``total_bytes``."""
    return max(AUTO_MARGIN_BYTES, int(total_bytes * AUTO_MARGIN_FRACTION))


def auto_vram_budget(device: str = "cuda") -> int | None:
    """Free VRAM on ``device`` less a safety margin (bytes, at least 0); None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info(torch.device(device))
    return max(0, free - auto_margin(total))
