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
