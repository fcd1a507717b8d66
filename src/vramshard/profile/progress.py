"""How the profiler reports progress: a sink with ``start``, ``step`` and ``advance``.

Work is counted in *weights* (expected seconds), so a progress bar can show time left.
The default sink only logs at debug level; the CLI supplies a rich progress bar.
"""

from __future__ import annotations

import logging
import re
import time

log = logging.getLogger(__name__)


class ProgressSink:
    """Receives the profiler's progress. Subclass and override what you need."""

    def start(self, total_weight: float) -> None:
        """Called once with the expected total work (roughly seconds)."""

    def step(self, label: str) -> None:
        """A new point is being measured; ``label`` says what (``"cpu matmul bf16 M=16 …"``)."""
        log.debug("measuring %s", label)

    def advance(self, weight: float) -> None:
        """The current point is done; it was worth ``weight`` of the total."""


# A point's label less what names the point within its table (" M=16 K=…", " new=1 context=…", " 64 KiB").
_POINT = re.compile(r" (M=\d+|new=\d+|\d+ KiB)\b.*$")


class TableClock(ProgressSink):
    """Passes everything on to ``inner`` and adds up the wall time by table: from each point's
    ``step`` to the next one's, under the point's label less its coordinates (``"cpu matmul bf16
    threads=16"``). What a table prepares before its first point (weights, cold copies) counts to
    the point before it. :meth:`finish` closes the last point; ``seconds`` holds the sums. Each table's
    start is logged (INFO) with the seconds since the profile's, so a profile cut short (a time limit,
    Ctrl-C) still says where its time went."""

    def __init__(self, inner: ProgressSink):
        self.inner = inner
        self.seconds: dict[str, float] = {}
        self._open: tuple[str, float] | None = None
        self._began = time.perf_counter()

    def start(self, total_weight: float) -> None:
        self._began = time.perf_counter()
        log.info("profiling: about %.0f s of measurements expected", total_weight)
        self.inner.start(total_weight)

    def step(self, label: str) -> None:
        table = _POINT.sub("", label)
        if self._open is None or self._open[0] != table:
            log.info("profiling %s (%.1f s in)", table, time.perf_counter() - self._began)
        self._close()
        self._open = (table, time.perf_counter())
        self.inner.step(label)

    def advance(self, weight: float) -> None:
        self.inner.advance(weight)

    def finish(self) -> dict[str, float]:
        """Close the last point; the sums, in seconds, rounded to 0.01 s."""
        self._close()
        return {table: round(seconds, 2) for table, seconds in self.seconds.items()}

    def _close(self) -> None:
        if self._open is not None:
            table, began = self._open
            self.seconds[table] = self.seconds.get(table, 0.0) + time.perf_counter() - began
            self._open = None
