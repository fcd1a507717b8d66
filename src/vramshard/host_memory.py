"""The host's memory as Linux reports it (``/proc/meminfo``)."""

from __future__ import annotations

from pathlib import Path


def meminfo_bytes(field: str) -> int | None:
    """``field`` of ``/proc/meminfo`` (``"MemTotal"``, ``"MemAvailable"``, …) in bytes; None where
    the file or the field is missing (not Linux)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
