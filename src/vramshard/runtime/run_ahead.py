"""Split FFNs' CPU parts on a worker thread, so the host thread queues the GPU work ahead of them.

In a split step the host thread is the critical path (the tenth GPU session): for each split FFN
it waits for the normalized activation, computes the CPU part, and only then queues the next
layer's GPU work — launches, ring fills and Python that the CPU cores sit idle through (19–41 ms
of a 116–192 ms llama3-8b step). Here the host thread hands the CPU part to a worker and goes on:

- the worker waits for the activation's copy to the host (an event), computes the CPU part into
  a pinned result buffer (:mod:`~vramshard.runtime.ffn_buffers`) and raises a ticket number in
  pinned host memory;
- the GPU stream meets a one-thread kernel that spins until that ticket is up, then copies the
  result in and adds it; everything queued after it (the next attention, the next FFN's GPU part)
  is already on the stream, so the GPU goes on as soon as the CPU part lands.

The step's order is the same as without: each CPU part reads the activation of its own layer and
the GPU reads each result after it is written, so the outputs are the same. A CPU part that
raises still raises the ticket (the GPU goes on) and fails its step with its error. The wait
kernel gives up after ``SPIN_LIMIT`` polls (minutes) rather than hang the GPU for ever, and flags
it; the step that sees the flag fails.

Opt-in (``VRAMSHARD_RUN_AHEAD=on``) until measured on a GPU; needs Triton.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

import torch

from ..env import switch
from .ffn_buffers import FFNBuffers

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (CPU-only torch): available() is False
    triton = None

log = logging.getLogger(__name__)

ENABLED = switch("VRAMSHARD_RUN_AHEAD", default=False)
# Polls of the ticket before the GPU stops waiting (each a read of host memory over PCIe, about a
# microsecond: some ten minutes, far beyond any CPU part; only a ticket never raised meets it).
SPIN_LIMIT = 600_000_000


def available() -> bool:
    """Whether run-ahead steps can run here (asked for, Triton installed, a GPU)."""
    return ENABLED and triton is not None and torch.cuda.is_available()


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


class RunAhead:
    """One executor's worker for CPU parts, its buffers, and the ticket the GPU waits on."""

    def __init__(self):
        self.ticket = torch.zeros(1, dtype=torch.int64, pin_memory=True)  # the last CPU part done
        self._ticket_view = self.ticket.numpy()
        self.gave_up = torch.zeros(1, dtype=torch.int32, pin_memory=True)  # set by a wait that hit SPIN_LIMIT
        self.buffers = FFNBuffers(pinned=True)  # the worker's: results pinned, read by copies to the GPU
        self._issued = 0
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Condition()
        self._finished = 0
        self._error: BaseException | None = None
        self.compute_s = self.wait_s = 0.0  # of the jobs since the last drain (StepReport's host timers)
        self._threads: int | None = None
        # A first launch: fails here, not mid-step, if Triton cannot read the pinned ticket.
        _wait_for_ticket[(1,)](self.ticket, 0, 1, self.gave_up)
        self._worker = threading.Thread(target=self._work, name="vramshard-cpu-parts", daemon=True)
        self._worker.start()

    def close(self) -> None:
        """Stop the worker once its jobs are done (the executor is going away)."""
        self._jobs.put(None)

    def submit(self, ready: torch.cuda.Event, job: Callable[[], None]) -> None:
        """Run ``job`` (it writes a CPU part into its buffer) on the worker once ``ready`` has
        completed, with the host thread's CPU thread count, then raise the ticket; queue the GPU's
        wait for it on the current stream."""
        self._issued += 1
        self._jobs.put((self._issued, ready, job, torch.get_num_threads()))
        _wait_for_ticket[(1,)](self.ticket, self._issued, SPIN_LIMIT, self.gave_up)

    def drain(self, stalled_s: float = 120.0) -> tuple[float, float]:
        """Wait for every job submitted; (seconds computing, seconds waiting for the GPU) of them.
        Raises the first error a job raised: the step's outputs are then wrong, the GPU having gone
        on with the buffer as it was. A worker that finishes no job for ``stalled_s`` is an error."""
        with self._done:
            while self._finished < self._issued:
                before = self._finished
                if not self._done.wait(stalled_s) and self._finished == before:
                    raise TimeoutError(f"split FFN CPU part {before + 1} has not finished in {stalled_s:.0f} s")
            error, self._error = self._error, None
            spent = self.compute_s, self.wait_s
            self.compute_s = self.wait_s = 0.0
        if error is not None:
            raise RuntimeError(f"a split FFN's CPU part failed: {error}") from error
        if self.gave_up[0]:  # a wait of this or an earlier step, once it has run
            self.gave_up.zero_()
            raise RuntimeError("the GPU stopped waiting for a split FFN's CPU part (SPIN_LIMIT): the outputs of "
                               "this step, or of the one before, are not to be trusted")
        return spent

    def _work(self) -> None:
        while (item := self._jobs.get()) is not None:
            number, ready, job, threads = item
            began = computing = time.perf_counter()
            try:
                if threads != self._threads:
                    torch.set_num_threads(threads)  # OpenMP's thread count is this thread's own
                    self._threads = threads
                ready.synchronize()
                computing = time.perf_counter()
                with torch.inference_mode():
                    job()
            except BaseException as exc:  # noqa: BLE001 - handed to the host thread by drain()
                log.exception("split FFN CPU part %d failed", number)
                with self._done:
                    self._error = self._error or exc
            finally:
                self._ticket_view[0] = number  # the GPU goes on, whatever happened
                with self._done:
                    self.wait_s += computing - began
                    self.compute_s += time.perf_counter() - computing
                    self._finished = number
                    self._done.notify_all()
