"""Split FFNs' CPU parts on a worker thread, so the host thread queues the GPU work ahead of them.

In a split step the host thread is the critical path (the tenth GPU session): for each split FFN
it waits for the normalized activation, computes the CPU part, and only then queues the next
layer's GPU work — launches, ring fills and Python that the CPU cores sit idle through (19–41 ms
of a 116–192 ms llama3-8b step). Here the host thread hands the CPU part to a worker and goes on:

- right after the activation's copy to the host, the GPU stream writes the part's number into a
  *ready* word in pinned host memory; the worker polls that word, computes the CPU part into a
  pinned result buffer (:mod:`~vramshard.runtime.ffn_buffers`) and raises the *ticket* word;
- the GPU stream meets a wait until that ticket is up, then copies the result in and adds it;
  everything queued after it (the next attention, the next FFN's GPU part) is already on the
  stream, so the GPU goes on as soon as the CPU part lands.

The worker makes no CUDA call at all, and every object that holds CUDA resources (the job's
pinned activation, its events) is released by the host thread. The first version waited on a
CUDA event on the worker, and freed the last job's event there: on the GPU machine
(2026-12-02) that hung its second step, the worker stuck in a CUDA call while the host thread
sat in a synchronous copy that waited for the GPU, which waited for the worker.

The step's order is the same as without: each CPU part reads the activation of its own layer and
the GPU reads each result after it is written, so the outputs are the same. A CPU part that
raises still raises the ticket (the GPU goes on) and fails its step with its error; so does a
part whose ready word has not come within ``READY_TIMEOUT_S``.

How the GPU writes and waits (``VRAMSHARD_RUN_AHEAD_WAIT``): ``kernel`` (default) — one-thread
Triton kernels, the wait spinning on the ticket and giving up after ``SPIN_LIMIT`` polls (about a minute;
the step that sees the flag fails); ``stream`` — the driver's stream memory operations
(:mod:`~vramshard.runtime.stream_wait`), which occupy no SM.

The GIL: the worker takes it back between the part's few torch calls, and while the host thread
runs Python (queuing the step) each take waits for the interpreter's switch interval, 5 ms by
default. On the GPU machine (thirteenth session) that made run-ahead steps slower than plain ones,
their CPU parts 1.7× as long; ``benchmarks/gil_handoff`` measured a part beside a busy Python
thread at 4.6× and 3.4× its time alone (1 and 64 rows) with 5 ms, 1.3× and 1.9× with 0.1 ms (the
2-core development machine, where the busy thread also takes a core). A worker
lowers the process's switch interval to ``SWITCH_INTERVAL_S`` (it is the process's, not the
thread's: a server's threads hand the GIL over as quickly too). Inductor's compiled CPU kernels
(a MoE layer's expert pass, the tuned projections) held the GIL through the kernel and were kept
off the worker; since session 24 they leave it (:func:`~vramshard.layers.cpu_compiled.kernels_release_gil`)
and the worker runs them: beside a busy Python thread, a Qwen3-30B-A3B layer's pass on the worker
took 6.3-6.8 ms against 3.1-3.3 alone on the development machine, and left the Python thread its
pace (``benchmarks/compiled_gil``); since session 25 a token's pass is one compiled call, which
takes the GIL back 2-6 times instead of 23-24, and it took 3.20-3.43 ms against 2.81-3.01 alone. A
dense part of one token takes it back about four times as one compiled function, which the worker
takes where it measures it faster (:mod:`~vramshard.layers.cpu_swiglu`), seven to nine projection by
projection. Not yet run on a GPU.

``VRAMSHARD_RUN_AHEAD``: ``auto`` (the default since session 42) gives the worker MoE layers' host
experts, ``bound`` also split dense FFNs' CPU parts that run as one bound C call (few rows through the C
kernel, :func:`bound_part`), ``on`` every split part, ``off`` nothing. In the thirty-seventh GPU session
(docs/BENCHMARKS.md; H100, qwen3-30b-a3b at 8 GiB, off/on/off/on in four processes) the planned engine
decoded 16.6 and 13.6 tok/s without the worker and 20.6 and 18.3 with it, experts-cpu 13.8 and 15.1 against
18.9 and 18.1. Dense split steps have not gained from it (nemo-8b at 8 GiB, thirty-first session: 10.83
tok/s with it, 10.95 without; llama3-8b's 64-row step, thirteenth: 167 ms against 121), when each part was a
Python job around three products that took the GIL back between them; since session 61 a part of up to the C
kernel's rows is one bound call as host experts are (:func:`~vramshard.layers.cpu_gemv.bind_swiglu_part`). Not yet
run on a GPU.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from typing import Callable

import torch

from ..env import choice, number, switch
from ..layers import cpu_compiled, cpu_gemv, host_experts
from .ffn_buffers import FFNBuffers
from .stream_wait import StreamWords

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (CPU-only torch): available() is False
    triton = None

log = logging.getLogger(__name__)

MODE = choice("VRAMSHARD_RUN_AHEAD", ("auto", "bound", "on", "off"), "auto")
ENABLED = MODE != "off"  # the worker computes MoE layers' host experts
BOUND = MODE in ("bound", "on")  # ... and split dense FFNs' CPU parts that run as one bound call
DENSE = MODE == "on"  # ... and every split dense FFN's CPU part
# Polls of the ticket before the GPU stops waiting (each a read of host memory over PCIe, about a
# microsecond: about a minute, far beyond any CPU part, e.g. ~0.2 s for a 2048-row prompt chunk's;
# only a ticket never raised meets it, and the step that sees the flag fails).
SPIN_LIMIT = 60_000_000
# How the GPU writes the ready word and waits for the ticket: "kernel" (Triton kernels) or
# "stream" (the driver's cuStreamWriteValue64 / cuStreamWaitValue64).
WAIT = os.environ.get("VRAMSHARD_RUN_AHEAD_WAIT", "kernel").strip().lower() or "kernel"
if WAIT not in ("kernel", "stream"):
    log.warning("VRAMSHARD_RUN_AHEAD_WAIT=%r is neither kernel nor stream: using kernel", WAIT)
    WAIT = "kernel"
# The worker first waits for the ready word in the C library's spin, the GIL free, for up to this
# long (VRAMSHARD_RUN_AHEAD_SPIN_US; 0: not at all): it sees the word within a microsecond, where a
# poll that sleeps between reads saw it up to a sleep late (20 us asked, 50-110 us slept on the
# development machine; on the H100 machine, thirty-fourth GPU session, an experts-cpu step's worker
# waited 0.17 ms a layer for the word). Then the polls below: a part whose input is long in coming
# (a prompt chunk's GPU work) leaves the worker's core to others.
SPIN_S = number("VRAMSHARD_RUN_AHEAD_SPIN_US", 500.0) * 1e-6
# The worker's polls of the ready word that only yield the GIL before it sleeps between polls
# (each poll takes the GIL from the host thread for a moment: few, while the host dispatches).
YIELDING_POLLS = 50
POLL_SLEEP_S = 20e-6
# Host-expert parts (since session 61 split dense FFNs' few-row parts too) as one bound C call
# (VRAMSHARD_RUN_AHEAD_ONE_CALL, default on): the worker waits for the
# ready word, computes into the result buffer and raises the ticket without Python, and so without taking the
# GIL back, between the GPU's word and the ticket the GPU waits for (cpu_gemv.BoundPart). Off: the part is a
# Python job around the same kernel (a C wait, the kernel's call, the copy into the buffer, the ticket). In the
# forty-first GPU session experts-cpu's worker spent 5.2 ms of a 54 ms step in that Python beside the kernel's
# 39.5 ms. With the one call (forty-second GPU session, five A/B pairs on two H100 machines) qwen3-30b-a3b at
# 8 GiB decoded 1.09-1.36x faster, the worker's computing its kernel alone.
ONE_CALL = switch("VRAMSHARD_RUN_AHEAD_ONE_CALL", default=True)
# A part whose ready word has not come after this fails (its ticket raised: the GPU goes on).
READY_TIMEOUT_S = 60.0
# The longest a thread waiting for the GIL waits while another runs Python (the interpreter's
# default is 5 ms; see the module's docstring).
SWITCH_INTERVAL_S = 1e-4


def _forced_team() -> int | None:
    text = os.environ.get("VRAMSHARD_WORKER_THREADS", "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        log.warning("VRAMSHARD_WORKER_THREADS=%r is not a thread count of 1 or more: ignored", text)
        return None
    return min(int(text), os.cpu_count() or int(text))


FORCED_TEAM = _forced_team()  # VRAMSHARD_WORKER_THREADS (see worker_threads)


def largest_team(asked: int) -> int:
    """The largest OpenMP team the worker takes for a part asked to run on ``asked`` threads: one
    core fewer than this process may use, at most. Through a run-ahead step the host thread keeps a
    core busy (Python queuing the step, then the CUDA driver spinning in its wait for the GPU), and
    an OpenMP team with one thread on that core waits for it at every barrier: on the GPU machine
    (thirteenth session) llama3-8b's run-ahead steps took 167 ms at 16 threads and 138 ms at 15 (64
    rows), 219 and 112 ms (1 row)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # (not Linux)
        cores = os.cpu_count() or asked
    return max(1, min(asked, cores - 1))


def worker_threads(asked: int, team: int | None = None) -> int:
    """The worker's OpenMP team for a part asked to run on ``asked`` threads: :func:`largest_team`,
    or ``team`` where that is smaller (the executor's: the plan's, from the profile's timing of the
    worker beside Python by team size, :func:`~vramshard.profile.bench_experts.team_candidates`, as
    the engine's steps tune it, :mod:`~vramshard.runtime.team_tuner`).
    ``VRAMSHARD_WORKER_THREADS=N`` sets it to N (within 1 and the cores), e.g. to compare teams."""
    if FORCED_TEAM:
        return FORCED_TEAM
    largest = largest_team(asked)
    return min(largest, team) if team else largest


def hand_the_gil_over_quickly() -> None:
    """Lower the interpreter's switch interval to ``SWITCH_INTERVAL_S`` (never raise it)."""
    if sys.getswitchinterval() > SWITCH_INTERVAL_S:
        log.info("run-ahead: the GIL's switch interval lowered from %.1f ms to %.2f ms",
                 sys.getswitchinterval() * 1e3, SWITCH_INTERVAL_S * 1e3)
        sys.setswitchinterval(SWITCH_INTERVAL_S)


def available(dense: bool = False) -> bool:
    """Whether run-ahead steps can run here (asked for, a GPU, and Triton for the kernels): for MoE
    layers' host experts, or (``dense``) for split dense FFNs' CPU parts (some: :func:`takes_dense`)."""
    return ENABLED and (BOUND or DENSE or not dense) and torch.cuda.is_available() \
        and (triton is not None or WAIT == "stream")


def bound_part(rows: int, dtype: torch.dtype) -> bool:
    """Whether a split dense FFN's CPU part of ``rows`` rows in ``dtype`` runs as one bound C call
    (:func:`~vramshard.layers.cpu_gemv.bind_swiglu_part`): the C kernel computes it here, as one call."""
    return ONE_CALL and dtype in cpu_gemv.DTYPES and (cpu_gemv.computes(rows) or cpu_gemv.amx_computes(rows, dtype))


def takes_dense(rows: int, dtype: torch.dtype) -> bool:
    """Whether the worker takes a split dense FFN's CPU part of ``rows`` rows in ``dtype`` (where it runs at
    all, :func:`available`): every part where ``on``, one that runs as one bound call where ``bound``."""
    return DENSE or (BOUND and bound_part(rows, dtype))


if triton is not None:

    @triton.jit
    def _wait_for_ticket(ticket_ptr, wanted, limit, gave_up_ptr):
        """Spin until the ticket in (pinned, device-visible) host memory reaches ``wanted``; after
        ``limit`` polls, go on and set the flag at ``gave_up_ptr``."""
        seen = tl.load(ticket_ptr, volatile=True)
        polls = 0
        while (seen < wanted) & (polls < limit):
            seen = tl.load(ticket_ptr, volatile=True)
            polls += 1
        tl.store(gave_up_ptr, 1, mask=seen < wanted)

    @triton.jit
    def _write_word(word_ptr, value):
        """Write ``value`` into the word in pinned host memory, through the GPU's L2 to the host
        (``st.wt``) so that the worker polling it sees it without any CUDA call."""
        tl.store(word_ptr, value, cache_modifier=".wt")


class RunAhead:
    """One executor's worker for CPU parts, its buffers, and the words the GPU and worker share.

    Per part, on the host thread: :meth:`copied` right after queuing the activation's copy to the
    host (the GPU then tells the worker it has landed), then :meth:`submit` with the job (the GPU
    then waits for it); :meth:`drain` at the end of the step."""

    def __init__(self):
        pinned = torch.cuda.is_available()  # (Triton's interpreter runs the kernels on the CPU: tests)
        self.ready = torch.zeros(1, dtype=torch.int64, pin_memory=pinned)  # the last part whose input landed
        self._ready_view = self.ready.numpy()
        self.ticket = torch.zeros(1, dtype=torch.int64, pin_memory=pinned)  # the last CPU part done
        self._ticket_view = self.ticket.numpy()
        self.gave_up = torch.zeros(1, dtype=torch.int32, pin_memory=pinned)  # set by a wait that hit SPIN_LIMIT
        self.buffers = FFNBuffers(pinned=pinned)  # the worker's: results pinned, read by copies to the GPU
        self._issued = 0  # parts whose input copy is queued (copied)
        self.team: int | None = None  # the OpenMP team of the parts submitted next (None: worker_threads's default)
        self._submitted = 0
        self._held: list = []  # the step's jobs: released on the host thread (drain), never on the worker
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Condition()
        self._finished = 0
        self._error: BaseException | None = None
        self.compute_s = self.wait_s = 0.0  # of the jobs since the last drain (StepReport's host timers)
        self._kernel_s = self._longest_s = 0.0  # of the jobs since the last drain: see last_parts
        self._idle_s = 0.0  # the worker's time between parts, a step's first excepted (see last_parts)
        self._parts = 0
        self.last_parts: dict[str, float] = {}  # what drain() last found: see _take_parts
        self._threads: int | None = None
        self._stream = StreamWords(self.ready, self.ticket) if WAIT == "stream" else None
        if self._stream is None:
            # First launches: fail here, not mid-step, if Triton cannot use the pinned words.
            _write_word[(1,)](self.ready, 0)
            _wait_for_ticket[(1,)](self.ticket, 0, 1, self.gave_up)
            if pinned:
                torch.cuda.current_stream().synchronize()
        hand_the_gil_over_quickly()
        self._worker = threading.Thread(target=self._work, name="vramshard-cpu-parts", daemon=True)
        self._worker.start()

    def close(self) -> None:
        """Stop the worker once its jobs are done (the executor is going away)."""
        self._jobs.put(None)

    def copied(self) -> int:
        """Queue, on the current stream, the word that tells the worker the next part's input has
        landed (call right after queuing that copy, before the GPU's own work); its number."""
        self._issued += 1
        if self._stream is not None:
            self._stream.write_ready(self._issued)
        else:
            _write_word[(1,)](self.ready, self._issued)
        return self._issued

    def submit(self, number: int, job: Callable[[], None] | cpu_gemv.BoundPart) -> None:
        """Run ``job`` (it writes part ``number``'s CPU result into its buffer, reading only host
        memory; or a bound C call that does, :class:`~vramshard.layers.cpu_gemv.BoundPart`) on the
        worker once its input has landed, with the host thread's CPU thread count (less the host
        thread's own core: :func:`worker_threads`), then raise the ticket; queue the GPU's wait for it
        on the current stream."""
        if not self._submitted < number <= self._issued:  # (a gap: a step failed between copied and submit)
            raise RuntimeError(f"CPU part {number} submitted out of order (after {self._submitted}, "
                               f"{self._issued} copied)")
        self._submitted = number
        self._held.append(job)
        self._jobs.put((number, job, worker_threads(torch.get_num_threads(), self.team)))
        if self._stream is not None:
            self._stream.wait_ticket(number)
        else:
            _wait_for_ticket[(1,)](self.ticket, number, SPIN_LIMIT, self.gave_up)

    def result_on(self, device: torch.device, number: int, like: torch.Tensor,
                  fill: Callable[[torch.Tensor], object],
                  bind: Callable[[torch.Tensor], cpu_gemv.BoundPart | None] | None = None) -> torch.Tensor:
        """Part ``number`` as a whole: ``fill`` writes its result (shaped and typed as ``like``,
        [T, D]) into a pinned buffer on the worker; returns the result's copy on ``device``, queued
        behind the GPU's wait for it (nothing here waits). ``bind``: the part as one C call into that
        buffer, where it gives one (:data:`ONE_CALL`), run by the worker instead of ``fill``."""
        out = self.buffers.result(like.shape[0], like.shape[-1], like.dtype)
        part = bind(out) if bind is not None and ONE_CALL else None
        self.submit(number, part if part is not None else lambda: fill(out))
        on_device = out.to(device, non_blocking=True)
        self.buffers.copying()  # the buffer is not handed out again before this copy is done
        return on_device

    def drain(self, stalled_s: float = 120.0) -> tuple[float, float]:
        """Wait for every job submitted; (seconds computing, seconds waiting for the GPU) of them.
        Raises the first error a job raised: the step's outputs are then wrong, the GPU having gone
        on with the buffer as it was. A worker that finishes no job for ``stalled_s`` is an error."""
        with self._done:
            while self._finished < self._submitted:
                before = self._finished
                if not self._done.wait(stalled_s) and self._finished == before:
                    raise TimeoutError(f"CPU part {before + 1} has not finished in {stalled_s:.0f} s")
            error, self._error = self._error, None
            spent = self.compute_s, self.wait_s
            self.compute_s = self.wait_s = 0.0
            self._take_parts()
        self._held.clear()  # the jobs' pinned inputs are freed here, on the host thread
        if error is not None:
            raise RuntimeError(f"a CPU part on the run-ahead worker failed: {error}") from error
        if self.gave_up[0]:  # a wait of this or an earlier step, once it has run
            self.gave_up.zero_()
            raise RuntimeError("the GPU stopped waiting for a CPU part (SPIN_LIMIT): the outputs of "
                               "this step, or of the one before, are not to be trusted")
        return spent

    def _take_parts(self) -> None:
        """``last_parts``: the parts since the last drain, their count, their longest computing,
        how much of their computing was the one-token expert pass's compiled call (seconds), the
        OpenMP team the last of them ran with, how long the worker spent between one part's end and the
        next one's start (``idle_s``, the step's first part excepted: its own bookkeeping, taking the GIL
        back, and waiting for the host thread's next part), and how long the host thread
        waited for a result buffer to be free (``host_buffer_wait_s``: it was two parts ahead, so
        behind the worker and the GPU)."""
        self.last_parts = {"parts": self._parts, "longest_s": self._longest_s, "expert_kernel_s": self._kernel_s,
                           "team": self._threads, "idle_s": self._idle_s,
                           "host_buffer_wait_s": self.buffers.take_waited_s()}
        self._kernel_s = self._longest_s = self._idle_s = 0.0
        self._parts = 0

    def _work(self) -> None:
        done = time.perf_counter()
        while (item := self._jobs.get()) is not None:
            number, job, threads = item
            del item
            began = time.perf_counter()
            idle = began - done if self._parts else 0.0  # (a step's first part waits while the host samples)
            kernel_before = host_experts.kernel_seconds()
            if isinstance(job, cpu_gemv.BoundPart):
                computing = self._run_bound(number, job, threads)
                kernel = time.perf_counter() - computing if job.experts else 0.0  # (the call's computing)
            else:
                computing = self._run(number, job, threads)
                kernel = host_experts.kernel_seconds() - kernel_before
            del job  # the host thread holds it too (_held) and releases it, with its pinned memory
            done = time.perf_counter()
            with self._done:
                self.wait_s += computing - began
                self.compute_s += done - computing
                self._kernel_s += kernel
                self._longest_s = max(self._longest_s, done - computing)
                self._idle_s += idle
                self._parts += 1
                self._finished = number
                self._done.notify_all()

    def _run(self, number: int, job: Callable[[], None], threads: int) -> float:
        """Part ``number`` on the worker: wait for its input, compute, raise the ticket whatever
        happened. No CUDA call. Returns when it began computing (``time.perf_counter``)."""
        computing = time.perf_counter()
        try:
            self._use_team(threads)
            if SPIN_S and self._ready_view[0] < number:  # the GPU writes it once the part's input has landed
                cpu_gemv.wait_for_word(self.ready, number, SPIN_S)
            self._poll_ready(number, computing)
            computing = time.perf_counter()
            # (compiled kernels run here only where they leave the GIL: cpu_compiled.kernels_release_gil)
            with torch.inference_mode(), cpu_compiled.gil_kept_free():
                job()
        except BaseException as exc:  # noqa: BLE001 - handed to the host thread by drain()
            log.exception("CPU part %d failed on the run-ahead worker", number)
            with self._done:
                self._error = self._error or exc
        finally:
            self._ticket_view[0] = number  # the GPU goes on, whatever happened
        return computing

    def _run_bound(self, number: int, part: cpu_gemv.BoundPart, threads: int) -> float:
        """Part ``number`` as its one C call (:class:`~vramshard.layers.cpu_gemv.BoundPart`): the call waits
        for the ready word, computes and raises the ticket; where the word has not come within ``SPIN_S``,
        the worker polls for it as :meth:`_run` does and calls again. Returns when it began computing."""
        began = time.perf_counter()
        computing = began
        try:
            self._use_team(threads)
            status, waited = part.run(self.ready, self.ticket, number, SPIN_S, threads)
            computing = began + waited
            if status == part.NOT_READY:
                self._poll_ready(number, began)
                computing = time.perf_counter()
                status, _ = part.run(self.ready, self.ticket, number, 0.0, threads)
        except BaseException as exc:  # noqa: BLE001 - handed to the host thread by drain()
            log.exception("CPU part %d failed on the run-ahead worker", number)
            with self._done:
                self._error = self._error or exc
        finally:
            self._ticket_view[0] = number  # (the call raised it unless it failed before computing)
        return computing

    def _use_team(self, threads: int) -> None:
        if threads != self._threads:
            torch.set_num_threads(threads)  # OpenMP's thread count is this thread's own
            self._threads = threads

    def _poll_ready(self, number: int, since: float) -> None:
        """Poll the ready word until part ``number``'s input has landed, yielding the GIL, then sleeping
        between polls; TimeoutError after ``READY_TIMEOUT_S`` from ``since``."""
        polls, ready = 0, self._ready_view
        while ready[0] < number:
            polls += 1
            time.sleep(0 if polls < YIELDING_POLLS else POLL_SLEEP_S)
            if polls % 1000 == 0 and time.perf_counter() - since > READY_TIMEOUT_S:
                raise TimeoutError(f"the GPU has not told the worker in {READY_TIMEOUT_S:.0f} s that CPU part "
                                   f"{number}'s input landed (ready word at {int(ready[0])})")
