"""Wall seconds by phase: where loading an engine spends its time.

A planned engine's load does several kinds of work (reading the checkpoint, planning, laying the
weights out in pinned host memory, copies the CPU parts read, compiling the CPU kernels, filling
VRAM); which of them dominates depends on the machine, and a load of a minute says nothing about
why. :class:`Timeline` adds up each phase's seconds, so the engine can say.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator


class Timeline:
    """Seconds by phase name, in the order the phases were first met; a phase met again adds up."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def merge(self, other: "Timeline") -> None:
        """Add ``other``'s phases to this timeline's."""
        for name, seconds in other.seconds.items():
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def describe(self) -> str:
        """``"12.3 s: plan 0.4 s, host layout 5.1 s, ..."``"""
        parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.seconds.items())
        return f"{self.total:.1f} s" + (f": {parts}" if parts else "")
