"""The host's memory as Linux reports it (``/proc/meminfo``)."""

from __future__ import annotations

from pathlib import Path

from .errors import HostMemoryError
from .units import format_bytes


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


def check_available(nbytes: int, what: str) -> None:
    """Raise :class:`~vramshard.errors.HostMemoryError` where Linux reports less memory available
    (``MemAvailable``) than the ``nbytes`` that ``what`` needs; nothing where it cannot tell.

    The weights' host copy is pinned (page-locked): it cannot be swapped out, and a process that
    pins more than the host has is killed by the kernel, mid-load, with nothing said."""
    available = meminfo_bytes("MemAvailable")
    if available is not None and nbytes > available:
        raise HostMemoryError(f"{what} need {format_bytes(nbytes)} of host memory; {format_bytes(available)} "
                              "is available. Close other programs, or choose a smaller model or dtype")
