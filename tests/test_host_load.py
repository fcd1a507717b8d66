"""The load beside the engine (runtime/host_load.py) and the CPU work judged again when it moves for good."""

import os

import pytest

from vramshard.plan import calibrate
from vramshard.runtime import host_load
from vramshard.runtime.host_load import HOLD, MIN_INTERVAL_S, PERIOD_S, LoadShift, OtherLoad

from test_calibrate import simulated_engine


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def write_counters(tmp_path, busy: dict, idle: int, own: tuple[int, int]) -> tuple[str, str]:
    """/proc/stat with these ticks (user, nice, system, irq, softirq, steal; idle, iowait) and
    /proc/self/stat with this process's (utime, stime), under a command name with spaces."""
    stat = tmp_path / "stat"
    fields = [busy.get("user", 0), busy.get("nice", 0), busy.get("system", 0), idle, 7, busy.get("irq", 0),
              busy.get("softirq", 0), busy.get("steal", 0), 0, 0]
    stat.write_text("cpu  " + " ".join(map(str, fields)) + "\ncpu0 1 2 3 4 5 6 7 8 9 10\nintr 1\n")
    mine = tmp_path / "self_stat"
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime ...
    mine.write_text(f"4242 (python3 -m x) S 1 1 1 0 -1 0 10 0 0 0 {own[0]} {own[1]} 0 0 20 0 9 0 100\n")
    return str(stat), str(mine)


def test_the_cores_busy_outside_this_process_come_from_the_kernels_counters(tmp_path):
    clock = Clock()
    stat, mine = write_counters(tmp_path, {"user": 1000, "system": 500}, idle=9000, own=(200, 100))
    load = OtherLoad(stat, mine, clock)
    load.ticks_per_second = 100.0
    assert load.cores() is None  # the first reading only starts the count
    # 2 s later: 1200 busy ticks more, 400 of them this process's, steal counted, idle and iowait not
    stat, mine = write_counters(tmp_path, {"user": 1800, "system": 700, "steal": 100, "irq": 50, "softirq": 50},
                                idle=12000, own=(500, 200))
    clock.now += 2.0
    assert load.cores() == pytest.approx((1200 - 400) / 100 / 2.0)
    assert load.own == pytest.approx(400 / 100 / 2.0)  # (this process's cores, same readings)
    assert load.steal == pytest.approx(100 / 100 / 2.0)  # (of the others' cores, the virtual machine's host's)
    clock.now += 1.0  # nothing more: nobody busy
    assert load.cores() == 0.0 and load.steal == 0.0
    assert load.cores() is None  # no time passed


def test_the_planning_processs_time_is_the_engines_where_both_readings_saw_it(tmp_path):
    clock = Clock()
    (tmp_path / "proc" / "77").mkdir(parents=True)
    child = tmp_path / "proc" / "77" / "stat"

    def child_ticks(utime: int) -> None:
        child.write_text(f"77 (python3) S 1 1 1 0 -1 0 0 0 0 0 {utime} 0 0 0 20 0 1 0 100\n")

    children = []
    stat, mine = write_counters(tmp_path, {"user": 1000}, idle=9000, own=(100, 0))
    load = OtherLoad(stat, mine, clock, children=lambda: children, proc=str(tmp_path / "proc"))
    load.ticks_per_second = 100.0
    child_ticks(50)
    children.append(77)
    load.cores()
    # 1 s: 300 busy ticks, 100 this process's, 150 the planner's: 50 others'
    write_counters(tmp_path, {"user": 1300}, idle=9100, own=(200, 0))
    child_ticks(200)
    clock.now += 1.0
    assert load.cores() == pytest.approx(0.5)
    # the planner ends: its last ticks are not taken as the engine's (a child gone is not in the reading)
    children.clear()
    write_counters(tmp_path, {"user": 1500}, idle=9200, own=(300, 0))
    clock.now += 1.0
    assert load.cores() == pytest.approx(1.0)
    children.append(78)  # a pid with no counters (it ended before the reading): skipped
    clock.now += 1.0
    assert load.cores() == 0.0


def test_without_the_counters_there_is_no_reading(tmp_path):
    assert OtherLoad(str(tmp_path / "none"), str(tmp_path / "none")).cores() is None
    (tmp_path / "stat").write_text("garbage\n")
    (tmp_path / "self").write_text("1 (x) S\n")
    broken = OtherLoad(str(tmp_path / "stat"), str(tmp_path / "self"))
    assert broken.cores() is None and not broken.available


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="Linux's /proc counters")
def test_this_machines_counters_read():
    load = OtherLoad()
    load.cores()
    load._last = (load._last[0] - 1.0, *load._last[1:])  # as if a second had passed
    cores = load.cores()
    assert cores is not None and 0 <= cores <= 4 * (os.cpu_count() or 1)


class Readings:
    """An OtherLoad whose readings are given."""

    def __init__(self, values):
        self.values = list(values)

    def cores(self):
        return self.values.pop(0) if self.values else None


def shift_of(values, cores: int = 16) -> tuple[LoadShift, Clock]:
    clock = Clock()
    return LoadShift(Readings(values), cores=cores, clock=clock), clock


def polls(shift: LoadShift, clock: Clock, count: int) -> list[bool]:
    out = []
    for _ in range(count):
        out.append(shift.poll())
        clock.now += PERIOD_S
    return out


def test_a_lasting_change_counts_and_a_spike_does_not():
    shift, clock = shift_of([1.0, 1.2, 6.0, 1.1, 6.0, 6.2, 5.9, 6.1])
    assert shift.poll() is False and shift.latest == 1.0 and shift.reference is None  # no reference before settle
    shift.settle()
    clock.now += PERIOD_S
    assert polls(shift, clock, 3) == [False, False, False]  # 1.2, a spike of 6.0, back to 1.1
    assert polls(shift, clock, HOLD) == [False] * (HOLD - 1) + [True]  # HOLD readings in a row 2+ cores away
    assert shift.reference == pytest.approx(5.9)
    assert shift.poll() is False  # (within the period: not read)


def test_a_change_under_the_threshold_or_soon_after_another_does_not_count():
    shift, clock = shift_of([0.0] + [0.8] * 10, cores=8)  # threshold: 1 core on 8
    shift.settle()
    assert not any(polls(shift, clock, 11))
    big, clock = shift_of([0.0] + [3.0] * 3 + [0.0] * 30, cores=32)  # threshold: 4 cores on 32
    big.settle()
    assert not any(polls(big, clock, 4))
    swings, clock = shift_of([0.0] + [8.0] * 3 + [0.0] * 20)
    swings.settle()
    seen = polls(swings, clock, 24)
    assert seen.index(True) == HOLD and sum(seen) == 2  # back to 0 counts too, but not before MIN_INTERVAL_S
    assert (seen.index(True, HOLD + 1) - HOLD) * PERIOD_S >= MIN_INTERVAL_S


def test_a_settle_before_any_reading_takes_the_next_one():
    shift, clock = shift_of([None, 3.0, 3.1, 9.0, 9.0, 9.0])
    shift.settle()
    assert polls(shift, clock, 6) == [False, False, False, False, False, True] and shift.reference == 9.0


@pytest.fixture
def torch_threads():
    """The process's torch threads as they were, after the test (an engine's limit sets them)."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_an_engine_computes_on_the_cores_left_and_judges_its_cpu_work_again_when_the_load_moves(
        tiny_model_dir, monkeypatch, torch_threads):
    """A game takes one of the 2 cores beside the engine after its CPU work was judged (as priced, here):
    the engine computes on the one left, plans again at one thread, times its tiers afresh and fits them
    where they run off; MAX_CALIBRATIONS counts afresh, the plans measured before are no longer the ones to
    beat, and the fit is not stored for later processes."""
    from vramshard import budget_follower

    monkeypatch.setattr(calibrate, "MIN_CPU_S", 0.0)  # the tiny model's CPU work is far below a real one's
    learned = []
    monkeypatch.setattr(calibrate, "learn", lambda profile, dtype: learned.append(profile))
    engine, reference = simulated_engine(tiny_model_dir("qwen3"))
    follower = engine.budget
    shift, clock = shift_of([0.1] * 3 + [1.2] * HOLD, cores=2)
    follower.load_shift = shift
    prompt = [5, 9, 11, 13, 2, 7]
    expected = reference.generate([prompt], 8)
    plan, profile = engine.plan, follower.plan_settings().profile
    predicted = calibrate.cpu_seconds(engine.model, profile, plan, 1)
    check = engine.cpu_check()
    for _ in range(9):  # the first is the tier's warm-up
        check.add(1, predicted)
    engine.poll_budget()
    assert follower.calibrations == [] and follower.cpu_judged == {1} and shift.settled  # judged: as priced
    # Fits and measured plans from before (as if), which the change leaves behind.
    follower.calibrations.extend({"earlier": n} for n in range(budget_follower.MAX_CALIBRATIONS))
    follower.fastest[None] = "a plan measured under the old load"
    for _ in range(3 + HOLD):  # readings: the reference, two more at 1 core; then the game's
        clock.now += PERIOD_S
        engine.poll_budget()
    (change,) = follower.load_changes
    assert change["other_cores_before"] == 0.1 and change["other_cores_now"] == 1.2 and change["tiers"] == [1]
    assert change["threads"] == 1 and engine.executor.threads == 1  # 2 cores less 1 busy
    assert follower.plan_settings().profile.thread_limit == 1 and follower.refine_why == "host load"
    assert follower.cpu_judged == set() and engine.calibration_pending()
    assert engine.cpu_stats()["load_changes"] == [change] and engine.cpu_stats()["other_cores_busy"] == 1.2
    assert follower.fastest == {} and not follower.learning
    follower.background.wait(60)
    engine.poll_budget()  # the plan at one thread comes in
    assert engine.plan is not plan and follower.events[-1]["why"] == "host load"
    check = engine.cpu_check()
    assert check.samples == {} and check.judged is follower.cpu_judged  # timed afresh
    now_predicted = calibrate.cpu_seconds(engine.model, follower.plan_settings().profile, engine.plan, 1)
    for _ in range(9):
        check.add(1, 2 * now_predicted)  # the game's cores: 2x slower
    engine.poll_budget()
    fit = follower.calibrations[-1]
    assert fit.get("cpu_measured_s") == {1: pytest.approx(2 * now_predicted)} and follower.cpu_judged == {1}
    assert learned == []  # this moment's load is not the machine's
    follower.background.wait(60)
    engine.poll_budget()
    assert engine.generate([prompt], 8) == expected


def test_the_threads_are_the_cores_left_up_to_the_processs_own():
    assert host_load.threads_beside(0.3, 16, 16) is None  # less than half a core: all
    assert host_load.threads_beside(6.4, 16, 16) == 10
    assert host_load.threads_beside(6.0, 16, 8) is None  # 10 left: as many as the process takes anyway
    assert host_load.threads_beside(14.0, 16, 8) == 2
    assert host_load.threads_beside(20.0, 16, 8) == 1  # (at least one)


def test_a_cpu_engine_computes_on_the_cores_left_within_its_own_limit(tiny_model_dir, torch_threads, monkeypatch):
    """With nothing to judge the load at the start is the reference; the threads follow the load both
    ways, never past the engine's own ``threads``."""
    import torch

    from vramshard import budget_follower
    from vramshard.engine import Engine

    monkeypatch.setattr(budget_follower, "default_threads", lambda: 16)  # (a 16-core machine's process)

    engine = Engine.load(tiny_model_dir("llama"), device="cpu", dtype="float32")
    prompt = [5, 9, 11, 13]
    expected = engine.generate([prompt], 6)
    shift, clock = shift_of([0.2] + [6.4] * HOLD + [0.0] * 30)
    engine.budget.load_shift = shift
    for _ in range(1 + HOLD):
        clock.now += PERIOD_S
        engine.poll_budget()
    assert engine.budget.load_changes[-1]["threads"] == 10 and engine.executor.threads == 10
    assert engine.generate([prompt], 6) == expected and torch.get_num_threads() == 10
    clock.now += MIN_INTERVAL_S
    for _ in range(HOLD):
        clock.now += PERIOD_S
        engine.poll_budget()
    assert engine.budget.load_changes[-1]["threads"] is None and engine.executor.threads is None  # all again
    limited = Engine.load(tiny_model_dir("llama"), device="cpu", dtype="float32", threads=1)
    shift, clock = shift_of([0.0] + [6.0] * HOLD)
    limited.budget.load_shift = shift
    for _ in range(1 + HOLD):
        clock.now += PERIOD_S
        limited.poll_budget()
    assert limited.budget.load_changes[-1]["threads"] == 1 and limited.executor.threads == 1  # its own limit


def test_the_load_is_followed_unless_turned_off(monkeypatch):
    """On by default (tests/conftest.py turns it off for the other tests; the module is read again here)."""
    from switch_helpers import assert_opt_out

    monkeypatch.delenv("VRAMSHARD_FOLLOW_HOST_LOAD")
    assert_opt_out(monkeypatch, host_load, "VRAMSHARD_FOLLOW_HOST_LOAD")


def test_an_engine_that_follows_the_load_reads_the_hosts_counters(monkeypatch, tiny_model_dir):
    monkeypatch.setattr(host_load, "ENABLED", True)
    engine, _ = simulated_engine(tiny_model_dir("qwen3"))
    shift = engine.budget.load_shift
    assert isinstance(shift, host_load.LoadShift) and isinstance(shift.load, host_load.OtherLoad)
    assert shift.load.stat_path == "/proc/stat" and shift.cores == os.cpu_count()
    from vramshard.runtime import plan_process

    assert shift.load.children is plan_process.child_pids  # (the planner's time is the engine's)


def test_the_load_is_not_followed_when_turned_off(monkeypatch, tiny_model_dir):
    monkeypatch.setattr(host_load, "ENABLED", False)
    engine, _ = simulated_engine(tiny_model_dir("qwen3"))
    assert engine.budget.load_shift is None and engine.cpu_stats()["other_cores_busy"] is None


def test_the_steps_spare_a_core_while_the_planning_process_plans(tiny_model_dir, torch_threads, monkeypatch):
    """While the planning process makes a plan (at the idle scheduling class it gets no core beside a
    team on every core), the steps compute on one thread fewer; the same tokens; all threads again after."""
    import torch

    from vramshard import budget_follower
    from vramshard.engine import Engine
    from vramshard.runtime import executor as executor_module
    from vramshard.runtime import plan_process

    monkeypatch.setattr(executor_module, "default_threads", lambda: 2)
    engine = Engine.load(tiny_model_dir("llama"), device="cpu", dtype="float32")
    prompt = [5, 9, 11, 13]
    expected = engine.generate([prompt], 6)
    assert torch.get_num_threads() == 2
    in_flight = [True]
    monkeypatch.setattr(plan_process, "planning", lambda: in_flight[0])
    assert engine.generate([prompt], 6) == expected
    assert engine.executor.sparing_core and torch.get_num_threads() == 1
    in_flight[0] = False
    assert engine.generate([prompt], 6) == expected and torch.get_num_threads() == 2
    in_flight[0] = True
    monkeypatch.setattr(budget_follower, "SPARE_PLANNING_CORE", False)  # (VRAMSHARD_SPARE_PLANNING_CORE=off)
    assert engine.generate([prompt], 6) == expected and torch.get_num_threads() == 2


def test_a_core_is_spared_down_to_one_thread_and_within_the_limits():
    from vramshard.runtime.executor import Executor

    executor = Executor.__new__(Executor)  # (only the thread arithmetic)
    executor.threads, executor.sparing_core = None, True
    assert executor._tier_threads(8) == 7 and executor._tier_threads(1) == 1
    executor.threads = 4
    assert executor._tier_threads(8) == 3 and executor._tier_threads(None) == 3
    executor.sparing_core = False
    assert executor._tier_threads(8) == 4 and executor._tier_threads(None) == 4


def test_the_load_is_followed_while_a_plan_is_awaited(tiny_model_dir, monkeypatch, torch_threads):
    """A calibration's plan still in the making does not stop the readings: a game that starts meanwhile
    limits the threads at once and asks for the plan at the cores left instead."""
    engine, _ = simulated_engine(tiny_model_dir("qwen3"))
    follower = engine.budget
    shift, clock = shift_of([0.1] * 3 + [1.2] * HOLD, cores=2)
    follower.load_shift = shift
    shift.settle()
    follower.refine, follower.refine_why = (follower.watcher.in_force, None), "calibrate"
    monkeypatch.setattr(follower, "_full_plan_ready", lambda budget, kv_forced: False)  # (never comes)
    monkeypatch.setattr(follower, "_quick_plan_ready", lambda budget, kv_forced: False)  # (nor its quick plan)
    for _ in range(3 + HOLD):
        clock.now += PERIOD_S
        engine.poll_budget()
    assert engine.cpu_stats()["other_cores_busy"] == 1.2
    (change,) = follower.load_changes
    assert change["threads"] == 1 and engine.executor.threads == 1 and follower.refine_why == "host load"
    follower.background.wait(60)


def test_the_work_beside_wants_more_cores_than_it_got_where_it_shared_them_with_the_engines_threads():
    from vramshard.runtime.host_load import wanted_beside

    # 2 cores: a process wanting one got 0.75 beside the engine's two threads (1.25 cores): it wants 1.2
    assert wanted_beside(0.75, 1.25, 2, 2) == pytest.approx(1.2)
    # 16 cores: 6 burners got 16 * 6 / 22 beside a team of 16 filling the rest: 6 wanted
    assert wanted_beside(16 * 6 / 22, 16 - 16 * 6 / 22, 16, 16) == pytest.approx(6.0)
    # the engine on the 10 cores left: the burners get what they want, and it is the reading again
    assert wanted_beside(6.0, 10.0, 10, 16) == pytest.approx(6.0)
    assert wanted_beside(0.75, 0.5, 2, 2) == 0.75  # idle cores: it got what it wanted
    assert wanted_beside(0.75, None, 2, 2) == 0.75 and wanted_beside(0.75, 1.25, None, 2) == 0.75  # (unknown)
    assert wanted_beside(1.99, 0.01, 2, 2) == 2.0  # (never more than the cores)
    assert wanted_beside(0.9, 1.0, 1, 2) == 0.9  # (never less than it got: one thread left it a core)


def test_a_shift_compares_what_the_work_beside_wants_with_the_engines_team():
    class Shared(Readings):
        own = 1.25  # the engine's two threads got the rest of the 2 cores

    def changes(team):
        # the development machine's readings of one burner beside the engine's two threads (session 43)
        shift = LoadShift(Shared([0.01, 0.74, 0.78, 0.71]), cores=2, clock=Clock())
        shift.poll(team=team)
        shift.settle()
        out = []
        for _ in range(3):
            shift.clock.now += PERIOD_S
            out.append(shift.poll(team=team))
        return out, shift

    changed, shift = changes(team=2)
    assert changed == [False, False, True] and shift.latest == pytest.approx(0.71 * 2 / 1.29)
    assert shift.latest_got == 0.71 and host_load.threads_beside(shift.reference, 2, 2) == 1
    assert changes(team=None)[0] == [False, False, False]  # as read: under the threshold twice of three
