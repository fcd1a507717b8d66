"""Timing one operation on the CPU (wall clock) or the GPU (CUDA events), time-bounded."""

from __future__ import annotations

import logging
import statistics
import sys
import threading
import time
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


def time_cpu(fn: Callable[[], object], budget_s: float, max_reps: int = 50, min_reps: int = 2) -> float:
    """Seconds of ``fn()`` after one warm-up run, repeating for about ``budget_s``.

    Returns the lower quartile of the runs: robust against other processes stealing the
    CPU for a while (they only ever make a run slower). A run longer than the budget is
    repeated once only (its warm-up is not counted).
    """
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    if first >= budget_s:
        start = time.perf_counter()
        fn()
        return min(first, time.perf_counter() - start)
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() < deadline):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[(len(times) - 1) // 4]


class StealGuard:
    """:func:`time_cpu`, timed again where a virtual machine's host stole this machine's CPUs meanwhile.

    Stolen time is time the guest's threads wanted to run and its host ran another guest: it lands in the
    timing (an OpenMP team waits at each barrier for its descheduled thread), and it is not this machine's
    speed. :meth:`time` reads the steal over each timing (``load``: a
    :class:`~vramshard.runtime.host_load.OtherLoad` of its own) and, where it reached ``limit_cores`` (at
    least two clock ticks of it), times the work again, up to ``retries`` times, keeping the fastest, until
    ``extra_budget_s`` of such timings are spent. ``retimed`` counts the timings taken again, ``stolen`` those
    still under steal after their retries. Without the kernel's counters it is plain :func:`time_cpu`. The host
    CPU of the GPU machine timed one product 2.4x apart minutes apart (fifty-fifth GPU session, cause unknown);
    on a host without steal this changes nothing."""

    LIMIT_CORES = 0.25  # a quarter of one CPU's time stolen over the timing

    def __init__(self, load=None, retries: int = 2, limit_cores: float = LIMIT_CORES, extra_budget_s: float = 60.0,
                 clock: Callable[[], float] = time.perf_counter):
        self.load = load if load is not None and load.available else None
        self.retries, self.limit_cores, self.extra_left_s, self.clock = retries, limit_cores, extra_budget_s, clock
        self.retimed = 0
        self.stolen = 0

    def time(self, fn: Callable[[], object], budget_s: float, **kwargs) -> float:
        """Seconds of ``fn()`` as :func:`time_cpu` times them (``kwargs`` passed on), timed again under steal."""
        if self.load is None:
            return time_cpu(fn, budget_s, **kwargs)
        best = float("inf")
        for attempt in range(self.retries + 1):
            self.load.cores()  # (starts the count)
            start = self.clock()
            best = min(best, time_cpu(fn, budget_s, **kwargs))
            seconds = self.clock() - start
            others = self.load.cores()
            steal = self.load.steal or 0.0
            if others is None or steal < self.limit_cores or steal * self.load.ticks_per_second * seconds < 2:
                return best
            if attempt == self.retries or self.extra_left_s <= 0:
                break
            self.retimed += 1
            self.extra_left_s -= seconds
            log.debug("%.2f cores stolen over a %.3f s timing: timing it again", steal, seconds)
        self.stolen += 1
        return best


# The host thread's Python between two of its torch calls while it queues a step (see time_cpu_beside_python).
_HOST_PYTHON_RANGE = 1000  # sum(range(1000)): about 10 microseconds here


def time_cpu_beside_python(fn: Callable[[], object], budget_s: float, threads: int, switch_interval_s: float,
                           max_reps: int = 50) -> float:
    """:func:`time_cpu` of ``fn()`` on a worker thread of ``threads`` torch threads (in inference
    mode) while the calling thread queues work as the executor's host thread does, the interpreter's
    switch interval ``switch_interval_s`` meanwhile: how the executor's run-ahead worker computes CPU
    work while the host thread queues the step. Each time ``fn`` takes the GIL back after a torch call
    it waits for the host thread to hand it over, and the worker has the cores the host thread leaves
    it. A first call on the worker is not timed (kernels compiled per thread count compile there).

    The calling thread makes a torch call (on the GPU where there is one: a launch) between every ~10
    microseconds of Python, and gives the GIL up in each, as the host thread does between its
    launches (its Python between two of them: a few microseconds to a few tens, a Triton kernel's
    launch or a graph's lookup the longest). Until session 39 it ran Python alone, and gave the GIL
    up only when the switch interval forced it: on the H100 machine (thirty-fourth GPU session) that
    timed a Qwen3-30B-A3B layer's one-token experts on the worker at 33 GB/s (2.27 ms; 0.61 ms alone),
    where the engine's experts-cpu decode steps computed them in 0.72 ms a layer on the worker (its
    kernel 0.66 ms), and the planner priced that placement at 8.6 tok/s against 19.1 measured. On the development
    machine (one worker thread, ``benchmarks/beside_host``) a torch call between every 1-2 us of
    Python left the pass at its time alone, every 11 us 1.0-1.2x, every 37 us 1.3-2.2x, and pure
    Python 1.2-1.3x."""
    result: list[float] = []
    failure: list[BaseException] = []

    def worker_body() -> None:
        torch.set_num_threads(threads)  # (OpenMP's thread count is per thread)
        try:
            with torch.inference_mode():
                fn()
                result.append(time_cpu(fn, budget_s, max_reps))
        except BaseException as exc:  # (re-raised on the calling thread)
            failure.append(exc)

    before = sys.getswitchinterval()
    sys.setswitchinterval(switch_interval_s)
    worker = threading.Thread(target=worker_body, name="vramshard-profile-worker")
    try:
        worker.start()
        queued = torch.zeros(16, device="cuda" if torch.cuda.is_available() else "cpu")
        while worker.is_alive():
            queued.add_(1.0)  # the host thread's launch (the GIL given up in it)
            sum(range(_HOST_PYTHON_RANGE))  # and its Python
    finally:
        worker.join()
        sys.setswitchinterval(before)
    if failure:
        raise failure[0]
    return result[0]


def time_cuda(fn: Callable[[], object], budget_s: float, batches: int = 3, max_reps: int = 64) -> float:
    """Median GPU seconds of ``fn()`` on the current stream, timed with CUDA events.

    ``fn`` is launched back to back in ``batches`` batches sized to fill ``budget_s``, each behind
    a GPU sleep long enough for the host to queue the whole batch where issuing a call takes the
    host longer than the GPU runs it: the events then time the kernels alone, not the host's
    launch rate (which bounds kernels of a few microseconds, and which the estimator counts
    apart, as dispatch). ``max_reps`` keeps a batch within the driver's launch queue.
    """
    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    _hold_stream(2e-3)  # one call queued behind a sleep: its kernels' time alone
    host = time.perf_counter()
    start.record()
    fn()
    end.record()
    host = time.perf_counter() - host  # the host's cost of issuing one call
    end.synchronize()
    single = max(start.elapsed_time(end) / 1e3, 1e-7)
    reps = max(1, min(max_reps, int(budget_s / batches / single)))
    samples = []
    for _ in range(batches):
        if host > single:
            _hold_stream(2.0 * (host - single) * reps + 1e-4)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / reps)
    return statistics.median(samples)


_SLEEP_CYCLES_PER_S: list[float] = []


def host_issue_s(issue: Callable[[], object], budget_s: float, batches: int, reps: int) -> float:
    """The host's seconds per call of ``issue`` (which queues GPU work), the fastest of up to ``batches`` batches of
    ``reps`` calls (at least three, then until ``budget_s`` is spent); each batch's GPU work is waited for after
    its clock stops, so only the issuing is timed. The caller warms ``issue`` up."""
    torch.cuda.synchronize()
    best, deadline = float("inf"), time.perf_counter() + budget_s
    for batch in range(batches):
        start = time.perf_counter()
        for _ in range(reps):
            issue()
        best = min(best, (time.perf_counter() - start) / reps)
        torch.cuda.synchronize()
        if batch >= 2 and time.perf_counter() > deadline:
            break
    return best


def sleep_cycles_per_second() -> float:
    """Clock cycles per second of ``torch.cuda._sleep``, the GPU's spin kernel (measured once)."""
    import torch

    if not _SLEEP_CYCLES_PER_S:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)  # warm-up
        start.record()
        torch.cuda._sleep(2_000_000)
        end.record()
        end.synchronize()
        _SLEEP_CYCLES_PER_S.append(2_000_000 / max(start.elapsed_time(end) / 1e3, 1e-6))
    return _SLEEP_CYCLES_PER_S[0]


def _hold_stream(seconds: float) -> None:
    """Keep the current CUDA stream busy for about ``seconds`` (so launches queue up behind it)."""
    import torch

    torch.cuda._sleep(int(min(seconds, 0.5) * sleep_cycles_per_second()))


def time_wall_cuda(fn: Callable[[], object], budget_s: float, batches: int = 3, fastest: bool = False) -> float:
    """Median (or, with ``fastest``, lowest) wall seconds per ``fn()`` launched back to back
    with one synchronize per batch.

    This is what the host pays to issue work (launch overhead) when the GPU is not the limit.
    Other processes only ever add to it, so the lowest batch is the steadier estimate.
    """
    import torch

    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    single = max(time.perf_counter() - start, 1e-7)
    reps = max(1, int(budget_s / batches / single))
    samples = []
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / reps)
    return min(samples) if fastest else statistics.median(samples)
