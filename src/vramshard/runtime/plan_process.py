"""Background plans made in a child process (``VRAMSHARD_PLAN_PROCESS``), never on a thread beside the steps.

The planner is pure Python: a full plan of an 8B model takes 2-4 s of one core. Made on a thread of
the engine's process (the budget follower's background planner: the full plan after a quick one at
load or after a budget change, and each calibration's re-plan), it holds the interpreter's lock in
turns of the switch interval (5 ms), while the step thread gives the lock up in nearly every torch
call and waits up to a turn to take it back. On the H100 machine (session 34,
``docs/logs-run34/probe_call4.log``) llama3-8b's steps took 1.1-3.6 s while a plan was made beside
them, against 0.13 s for a decode step and 0.3 s for a 1024-token prompt step otherwise: the first
prompt after a load, and each calibration, stalled the engine for the whole plan. A child process has
an interpreter of its own; the steps lose at most a core of the CPU to it.

The child (``python -m vramshard.runtime.plan_process``) is started on the first request and kept:
it serves the plans of every engine of this process, one at a time, and is stopped when no request
came for ``IDLE_EXIT_S`` (its memory, mostly torch's, comes back; the next request starts another,
about 2 s). Each request carries the model's shapes, the plan settings (the machine profile with
its fitted factors), the budget and how this process's executor runs its CPU work
(:class:`~vramshard.plan.estimator.Mechanisms`), so the child prices exactly what this process's
own planner would: the plan is the same. Requests and answers cross the child's stdin and stdout
as pickles, each after its length: only between this process and the child it started, nothing
read from a file. A child that has not answered in ``ANSWER_S`` is killed. A child that fails is
replaced once; when none can be started or the replacement fails too, plans are made on the calling
thread again, with a warning, for the rest of the process (``VRAMSHARD_PLAN_PROCESS=off``: always).
"""

from __future__ import annotations

import logging
import os
import pickle
import struct
import subprocess
import sys
import threading
from pathlib import Path

from ..env import switch
from ..errors import VramshardError
from ..models.base import Model
from ..plan.estimator import Mechanisms, fixed_mechanisms
from ..plan.planner import PlanSet
from .budget import PlanSettings, make_plan

log = logging.getLogger(__name__)

ENABLED = switch("VRAMSHARD_PLAN_PROCESS", default=True)
IDLE_EXIT_S = 300.0  # a child without requests this long is stopped
ANSWER_S = 300.0  # a child that has not answered a request in this long is killed (a full plan takes seconds)
_LENGTH = struct.Struct("<Q")


class PlanProcessError(VramshardError):
    """The planning process could not be started, or failed outside the planner."""


def _send(stream, value) -> None:
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LENGTH.pack(len(data)) + data)
    stream.flush()


def _receive(stream):
    """The next message on ``stream``; EOFError at its end."""
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        raise EOFError("the stream ended")
    (length,) = _LENGTH.unpack(head)
    data = stream.read(length)
    if len(data) < length:
        raise EOFError("the stream ended inside a message")
    return pickle.loads(data)


class PlanProcess:
    """A child process that makes plans (see the module docstring). Thread-safe: requests from
    several threads are served one at a time."""

    def __init__(self, idle_exit_s: float = IDLE_EXIT_S, answer_s: float = ANSWER_S):
        self.idle_exit_s = idle_exit_s
        self.answer_s = answer_s
        self._lock = threading.Lock()
        self._child: subprocess.Popen | None = None
        self._idle: threading.Timer | None = None
        self.started = 0  # children started so far
        self.plans = 0  # plans made by them

    def make_plan(self, model: Model, settings: PlanSettings, budget: int | None, kv_on_gpu: bool | None = None,
                  search: bool = True) -> PlanSet:
        """:func:`~vramshard.runtime.budget.make_plan` in the child, pricing this process's mechanisms.
        A planner's error (a BudgetError) is raised here as it was there; PlanProcessError when the
        child cannot be started or does not answer."""
        request = (model, settings, budget, kv_on_gpu, search, Mechanisms.here())
        with self._lock:
            if self._idle is not None:
                self._idle.cancel()
            ok, value = self._ask(request, retry=self._child is not None)
            self._idle = threading.Timer(self.idle_exit_s, self._stop_if_idle)
            self._idle.daemon = True
            self._idle.start()
        if not ok:
            raise value
        self.plans += 1
        return value

    def _ask(self, request, retry: bool):
        """(ok, plan or exception) from the child (started here if none runs; killed when it has not
        answered in ``answer_s``); a child that was running and fails (it may have been killed) is
        replaced once (caller holds the lock)."""
        try:
            child = self._child or self._start()
            hung = threading.Timer(self.answer_s, child.kill)  # (the pipes then break: OSError or EOFError)
            hung.daemon = True
            hung.start()
            try:
                _send(child.stdin, request)
                return _receive(child.stdout)
            finally:
                hung.cancel()
        except (OSError, EOFError, pickle.PickleError, AttributeError, ImportError, TypeError) as exc:
            self._stop_locked()
            if retry:
                log.info("the planning process failed (%s: %s): starting another", type(exc).__name__, exc)
                return self._ask(request, retry=False)
            raise PlanProcessError(f"the planning process failed: {type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        """Stop the child (a later request starts another)."""
        with self._lock:
            if self._idle is not None:
                self._idle.cancel()
            self._stop_locked()

    @property
    def running(self) -> bool:
        return self._child is not None and self._child.poll() is None

    def _start(self) -> subprocess.Popen:
        source = str(Path(__file__).resolve().parents[2])  # (the directory holding this package)
        path = os.environ.get("PYTHONPATH")
        env = dict(os.environ, PYTHONPATH=source + (os.pathsep + path if path else ""),
                   OMP_NUM_THREADS="1")  # (one core: the steps keep the others)
        self._child = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, env=env)
        self.started += 1
        log.info("planning process started (pid %d)", self._child.pid)
        return self._child

    def _stop_if_idle(self) -> None:
        with self._lock:
            self._stop_locked()

    def _stop_locked(self) -> None:
        child, self._child = self._child, None
        if child is None:
            return
        try:
            child.stdin.close()  # (the child ends at the end of its input)
            child.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            child.kill()
            child.wait()


_shared: PlanProcess | None = None
_shared_lock = threading.Lock()
_failed: str | None = None  # why plans are made on the calling thread for the rest of the process


def shared() -> PlanProcess:
    """This process's planning process (one for every engine)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = PlanProcess()
        return _shared


def make_plan_off_thread(model: Model, settings: PlanSettings, budget: int | None, kv_on_gpu: bool | None = None,
                         search: bool = True) -> PlanSet:
    """A plan made in the shared planning process where it is on and works; else on this thread."""
    global _failed
    if ENABLED and _failed is None:
        try:
            return shared().make_plan(model, settings, budget, kv_on_gpu, search)
        except PlanProcessError as exc:
            _failed = str(exc)
            log.warning("%s; plans are made in this process from now on (steps run slower while one is made)",
                        exc)
    return make_plan(model, settings, budget, kv_on_gpu, search)


def _serve() -> None:
    """The child: answer requests from stdin on stdout until stdin ends."""
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # (anything printed goes to stderr, not into the replies)
    logging.basicConfig(level=logging.WARNING, format="vramshard planning process: %(levelname)s %(message)s")
    requests = sys.stdin.buffer
    while True:
        try:
            model, settings, budget, kv_on_gpu, search, mechanisms = _receive(requests)
        except EOFError:
            return
        try:
            with fixed_mechanisms(mechanisms):
                reply = (True, make_plan(model, settings, budget, kv_on_gpu, search))
        except Exception as exc:  # the planner's errors go back to be raised there
            reply = (False, exc)
        try:
            _send(replies, reply)
        except (pickle.PickleError, TypeError, AttributeError) as exc:  # (an exception that does not pickle)
            _send(replies, (False, PlanProcessError(f"the planner failed: {reply[1]!r} ({exc})")))


if __name__ == "__main__":
    _serve()
