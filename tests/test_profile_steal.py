"""The profiler's CPU timings taken again where a virtual machine's host stole the CPUs
(profile/timing.StealGuard), and the profile's CPU tables timed through it."""

import pytest

from vramshard.profile import bench_matmul, timing
from vramshard.profile.progress import ProgressSink
from vramshard.profile.timing import StealGuard


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Load:
    """runtime/host_load.OtherLoad's interface, with the steal of each timing scripted (cores)."""

    available = True
    ticks_per_second = 100.0

    def __init__(self, steals):
        self.steals = list(steals)
        self.steal = None
        self.readings = 0

    def cores(self):
        """Odd readings start a timing's count (None); even ones end it with the next scripted steal."""
        self.readings += 1
        if self.readings % 2:
            return None
        self.steal = self.steals.pop(0)
        return self.steal + 0.5  # (others: the steal and half a core of other work)


@pytest.fixture
def timings(monkeypatch):
    """time_cpu faked: each timing takes the next of ``times`` (seconds) on the clock and returns it."""
    clock = Clock()
    times = []

    def fake_time_cpu(fn, budget_s, **kwargs):
        seconds = times.pop(0)
        clock.now += seconds
        return seconds

    monkeypatch.setattr(timing, "time_cpu", fake_time_cpu)
    return clock, times


def test_a_timing_under_steal_is_taken_again_and_the_fastest_kept(timings):
    clock, times = timings
    # No steal: one timing.
    guard = StealGuard(Load([0.0]), clock=clock)
    times[:] = [0.1]
    assert guard.time(lambda: None, 0.08) == 0.1 and (guard.retimed, guard.stolen) == (0, 0)
    # A whole core stolen over the first timing, none over the second: timed twice, the faster kept.
    guard = StealGuard(Load([1.0, 0.0]), clock=clock)
    times[:] = [0.3, 0.1]
    assert guard.time(lambda: None, 0.08) == 0.1 and (guard.retimed, guard.stolen) == (1, 0)
    # Stolen every time: the retries spent, the fastest kept, counted as still stolen.
    guard = StealGuard(Load([1.0, 1.0, 1.0]), retries=2, clock=clock)
    times[:] = [0.3, 0.2, 0.25]
    assert guard.time(lambda: None, 0.08) == 0.2 and (guard.retimed, guard.stolen) == (2, 1)
    assert times == []


def test_little_steal_or_a_spent_budget_is_not_timed_again(timings):
    clock, times = timings
    # Under a quarter of a core; and a quarter of a core over 50 ms, one clock tick of it (too few to tell).
    for steal, seconds in ((0.2, 0.1), (0.25, 0.05)):
        guard = StealGuard(Load([steal]), clock=clock)
        times[:] = [seconds]
        assert guard.time(lambda: None, 0.08) == seconds and guard.retimed == 0 and guard.stolen == 0
    # The extra budget spent: the next stolen timing is kept as it is (and counted as stolen).
    guard = StealGuard(Load([1.0, 0.0, 1.0]), extra_budget_s=0.1, clock=clock)
    times[:] = [0.3, 0.1, 0.3]
    assert guard.time(lambda: None, 0.08) == 0.1 and guard.retimed == 1
    assert guard.time(lambda: None, 0.08) == 0.3 and (guard.retimed, guard.stolen) == (1, 1)
    # Without the kernel's counters: plain time_cpu.
    unavailable = Load([])
    unavailable.available = False
    times[:] = [0.4]
    assert StealGuard(unavailable, clock=clock).time(lambda: None, 0.08) == 0.4


def test_the_cpu_matmul_table_times_its_points_through_the_guard(monkeypatch):
    seen = []

    class Guard:
        def time(self, fn, budget_s):
            seen.append(budget_s)
            return 1e-3

    monkeypatch.setattr(bench_matmul, "time_cpu", lambda fn, budget_s: pytest.fail("timed around the guard"))
    table = bench_matmul.measure_matmul("cpu", "fp32", [(64, 64)], [1, 2], budget_s=0.01, cap_s=1.0,
                                        progress=ProgressSink(), label="t", weight=0, steal_guard=Guard())
    assert seen == [0.01, 0.01] and table["seconds"] == [[1e-3, 1e-3]]
