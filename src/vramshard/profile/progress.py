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
    Ctrl-C) still says where its time went.

    With ``load`` (a :class:`~vramshard.runtime.host_load.OtherLoad`, read at each point's end) it also
    keeps what ran on the CPUs beside each table (:meth:`beside`): the cores other processes kept busy, and
    of them the steal (a virtual machine's host running its other guests on its CPUs), and the cores the
    profile's own threads kept busy. The host CPU of the GPU machine timed the same product 2.4x apart
    minutes apart (fifty-fifth GPU session); this says whether other work took the CPUs meanwhile."""

    def __init__(self, inner: ProgressSink, load=None):
        self.inner = inner
        self.seconds: dict[str, float] = {}
        self.load = load if load is not None and load.available else None
        # table: [seconds read, others' cores x s, steal's cores x s, own cores x s]
        self._beside: dict[str, list[float]] = {}
        self._open: tuple[str, float] | None = None
        self._began = time.perf_counter()

    def start(self, total_weight: float) -> None:
        self._began = time.perf_counter()
        if self.load is not None:
            self.load.cores()  # (starts the count)
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

    def beside(self) -> dict | None:
        """What ran beside the profile: ``{"others_cores", "steal_cores", "own_cores", "by_table": {table: {...the
        same}}}``, the cores other processes kept busy on average (over the whole profile, and over each
        table's points), the steal among them, and the cores the profile's own threads kept busy; None without
        a load reader or a reading."""
        sums = [sum(column) for column in zip(*self._beside.values())] if self._beside else [0.0]
        if sums[0] <= 0:
            return None

        def cores(seconds: float, others: float, steal: float, own: float) -> dict[str, float]:
            return {"others_cores": round(others / seconds, 3), "steal_cores": round(steal / seconds, 3),
                    "own_cores": round(own / seconds, 3)}
        return {**cores(*sums), "by_table": {table: cores(*row) for table, row in self._beside.items() if row[0] > 0}}

    def _close(self) -> None:
        if self._open is not None:
            table, began = self._open
            seconds = time.perf_counter() - began
            self.seconds[table] = self.seconds.get(table, 0.0) + seconds
            self._open = None
            others = self.load.cores() if self.load is not None else None  # (since the point's start)
            if others is not None:
                sums = self._beside.setdefault(table, [0.0, 0.0, 0.0, 0.0])
                sums[0] += seconds
                sums[1] += others * seconds
                sums[2] += (self.load.steal or 0.0) * seconds
                sums[3] += (self.load.own or 0.0) * seconds
