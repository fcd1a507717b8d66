"""How many cores work other than the engine's keeps busy: the load beside it (a game, a build, the
system, and on a virtual machine its host's other guests).

The engine fits its profile's CPU times to its own steps once per tier (:mod:`vramshard.budget_follower`);
a game that starts, or stops, beside it later changes how long that CPU work takes, and the plan made for
the cores the engine had is then the wrong one, and an OpenMP team with a thread on a core the other work
holds waits for it at every barrier. This module gives the follower the signal to compute on the cores
left and fit again: the cores busy outside this process, from the kernel's counters (Linux ``/proc``),
averaged between two readings. Reading them costs a few tens of microseconds; elsewhere (no ``/proc``)
there is no reading. The engine's own planning process (:mod:`~vramshard.runtime.plan_process`) counts as
the engine's, between readings that both saw it.

:class:`LoadShift` says when that load has moved for good from what it was when the CPU work was last
judged (a lasting change of ``CHANGE_CORES`` or more, not a spike); what to do then is the follower's.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable

from ..env import switch

log = logging.getLogger(__name__)

ENABLED = switch("VRAMSHARD_FOLLOW_HOST_LOAD", True)
PERIOD_S = 2.0  # seconds between readings
HOLD = 3  # readings in a row beyond the change before it counts (a spike is not a new load)
# The least change in busy cores that counts (or an eighth of the cores, where more): a process that keeps
# one core busy read 0.95-1.04 cores on the development machine beside the engine's one thread, but 0.65-0.87
# beside its two (no change in 30 s, session 43): what it wants (wanted_beside) read 1.5.
CHANGE_CORES = 0.75
MIN_INTERVAL_S = 30.0  # between two changes that count (a load that swings back and forth is not chased)
SATURATED = 0.9  # of the cores busy (the engine's work and the rest) beyond which they shared the cores

# /proc/stat's first line: "cpu user nice system idle iowait irq softirq steal guest guest_nice" in
# clock ticks; guest time is already counted in user. Busy: all but idle and iowait.
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal
_STEAL_FIELD = 7  # the time a virtual machine's host ran something else while this machine's CPUs wanted to run


def available() -> bool:
    """Whether the engine follows the load beside it here (asked for, and the kernel's counters there)."""
    return ENABLED and os.path.exists("/proc/stat") and os.path.exists("/proc/self/stat")


def _ticks_per_second() -> float:
    try:
        return float(os.sysconf("SC_CLK_TCK"))
    except (AttributeError, ValueError, OSError):
        return 100.0


class OtherLoad:
    """The cores kept busy by work other than this process's, between readings.

    :meth:`cores` returns the average since the previous call that returned a value (the first call
    only starts the count); ``stat_path`` and ``self_path`` are the kernel's counters (paths given for
    tests), ``clock`` the time between readings."""

    def __init__(self, stat_path: str = "/proc/stat", self_path: str = "/proc/self/stat",
                 clock: Callable[[], float] = time.monotonic, children: Callable[[], list[int]] = lambda: [],
                 proc: str = "/proc"):
        self.stat_path, self.self_path, self.clock = stat_path, self_path, clock
        self.children, self.proc = children, proc  # (pids whose CPU time is this process's work, e.g. its planner)
        self.ticks_per_second = _ticks_per_second()
        # (time, (busy ticks of all, steal ticks), {None: this process's ticks, child pid: its ticks})
        self._last: tuple[float, tuple[int, int], dict] | None = None
        self.available = os.path.exists(stat_path) and os.path.exists(self_path)
        self.own: float | None = None  # the cores this process (and its children) kept busy, same readings
        # The cores' worth of the others' time that was steal, same readings: a virtual machine's host running
        # its other guests on this machine's CPUs (part of what :meth:`cores` returns).
        self.steal: float | None = None

    def cores(self) -> float | None:
        """Cores busy outside this process on average since the last reading (None: the first reading,
        no time passed, or no counters here)."""
        if not self.available:
            return None
        try:
            reading = (self.clock(), self._busy_ticks(), self._own_ticks())
        except (OSError, ValueError, IndexError) as exc:
            log.info("the host's CPU counters cannot be read (%s): the load beside the engine is not followed", exc)
            self.available = False
            return None
        last, self._last = self._last, reading
        if last is None or reading[0] <= last[0]:
            return None
        own = sum(ticks - last[2][pid] for pid, ticks in reading[2].items() if pid in last[2])  # (seen in both)
        others = (reading[1][0] - last[1][0]) - own
        seconds = reading[0] - last[0]
        self.own = own / self.ticks_per_second / seconds
        self.steal = max(0, reading[1][1] - last[1][1]) / self.ticks_per_second / seconds
        return max(0.0, others / self.ticks_per_second / seconds)

    def _busy_ticks(self) -> tuple[int, int]:
        """(busy ticks of all CPUs, the steal among them) so far."""
        with open(self.stat_path) as f:
            first = f.readline().split()
        if not first or first[0] != "cpu":
            raise ValueError(f"{self.stat_path} does not start with the all-CPU line")
        values = [int(v) for v in first[1:]]
        steal = values[_STEAL_FIELD] if _STEAL_FIELD < len(values) else 0
        return sum(values[i] for i in _BUSY_FIELDS if i < len(values)), steal

    def _own_ticks(self) -> dict:
        ticks = {None: _process_ticks(self.self_path)}
        for pid in self.children():
            try:
                ticks[pid] = _process_ticks(f"{self.proc}/{pid}/stat")
            except (OSError, ValueError, IndexError):
                pass  # (it ended meanwhile)
        return ticks


def _process_ticks(path: str) -> int:
    """A process's user and system clock ticks so far, from its ``/proc/PID/stat``."""
    with open(path) as f:
        text = f.read()
    fields = text.rpartition(")")[2].split()  # (the command name in parentheses may hold spaces)
    return int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of proc(5)


def wanted_beside(others: float, own: float | None, team: int | None, cores: int) -> float:
    """The cores the work beside the engine would keep busy were the engine not computing: ``others``,
    the cores it got, where the machine had idle cores; more where the engine's team of ``team``
    threads and that work filled the machine (``SATURATED`` of its cores busy, ``own`` being the
    engine's): each runnable thread then got about an equal share of the cores, so work that wants D
    cores got D·cores/(team + D) of them, and D = others·team/(cores − others). On the 2-core
    development machine a process that keeps a core busy read 0.65-0.87 cores beside the engine's two
    threads, and the engine never followed it (session 43, docs/BENCHMARKS.md); with this estimate it
    read 1.5 wanted and computed on the core left 13 s into the load. The estimate runs high (the work
    gets more than an equal share of a core while the engine's threads wait at barriers): the engine may
    give up a core or two too many. Once the engine computes on the cores left, the work gets what it wants and the
    estimate is the reading again."""
    if own is None or not team or own + others < SATURATED * cores or others >= cores:
        return others
    # (never less than it got: a team that leaves it more than a fair share did not crowd it)
    return min(float(cores), max(others, others * team / (cores - others)))


def threads_beside(others: float, cores: int, default: int) -> int | None:
    """The CPU threads to compute on with ``others`` of the machine's ``cores`` kept busy beside the engine:
    the cores left (at least one), or None (the process's ``default``) where the others keep less than half
    a core busy or leave as many cores as that default. An OpenMP team with a
    thread on a busy core waits for it at every barrier: on the 2-core development machine, with one
    core kept busy by another process, a CPU engine decoded at 5.21 tok/s on one thread and 3.43 on two
    (llama3-8b's shape cut to 4 layers, ``python -m benchmarks.load_beside``, docs/BENCHMARKS.md)."""
    busy = round(others)
    left = max(1, cores - busy)
    return None if busy < 1 or left >= default else left


class LoadShift:
    """Whether the load beside the engine has moved for good since it was last taken as the reference.

    :meth:`poll` at step boundaries reads :class:`OtherLoad` every ``PERIOD_S`` (the cores the other work
    wants: :func:`wanted_beside`, from the engine's team in the steps); :meth:`settle` takes the
    latest reading as the reference (when the CPU work was judged); :meth:`poll` returns True once
    ``HOLD`` readings in a row lie ``CHANGE_CORES`` (or an eighth of ``cores``) or more from the
    reference (and ``MIN_INTERVAL_S`` has passed since the last such change), and then takes the last of them
    as the new reference."""

    def __init__(self, load: OtherLoad | None = None, cores: int | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.load = load if load is not None else OtherLoad(clock=clock)
        self.clock = clock
        self.cores = cores or os.cpu_count() or 1  # (this machine's)
        self.threshold = max(CHANGE_CORES, self.cores / 8)
        self.reference: float | None = None  # others' cores when the CPU work was last judged
        self.latest: float | None = None  # the cores the other work wants, at the last reading
        self.latest_got: float | None = None  # the cores it kept busy then
        self.off = 0  # readings in a row beyond the threshold
        self.settled = False  # whether a reference was asked for (the CPU work judged)
        self._next_reading = clock()
        self._quiet_until = clock()  # no change counts before (MIN_INTERVAL_S after the last)

    def settle(self) -> None:
        """The latest reading becomes the reference (the CPU work was judged under it; where there is no
        reading yet, the next one does)."""
        self.settled, self.reference, self.off = True, self.latest, 0

    def poll(self, team: int | None = None) -> bool:
        """Read the load if a period has passed (``team``: the threads the engine's steps compute on);
        whether it has moved for good from the reference."""
        now = self.clock()
        if now < self._next_reading:
            return False
        self._next_reading = now + PERIOD_S
        got = self.load.cores()
        if got is None:
            return False
        cores = wanted_beside(got, getattr(self.load, "own", None), team, self.cores)
        self.latest, self.latest_got = cores, got
        if self.reference is None:
            if self.settled:
                self.reference = cores
            return False
        self.off = self.off + 1 if abs(cores - self.reference) >= self.threshold else 0
        if self.off < HOLD or now < self._quiet_until:
            return False
        self.reference, self.off, self._quiet_until = cores, 0, now + MIN_INTERVAL_S
        return True
