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
(:class:`~vramshard.plan.mechanisms.Mechanisms`), so the child prices exactly what this process's
own planner would: the plan is the same.

The child runs at the idle scheduling class (Linux ``SCHED_IDLE``; elsewhere at the lowest
priority), set before it imports anything: it takes a core only where none of this process's
threads wants one. At normal priority its one core cost every OpenMP team of the steps a thread
at each barrier: on the H100 machine (session 37, ``docs/logs-run37/llama8_call7.log``)
llama3-8b's one-token steps at 8 GiB took 113-632 ms (seven of nine above 240 ms) while a
calibration's plan was made in the child, against 130-142 ms before and 133 ms after. The plan
then takes longer (it waits for idle cores), and the engine runs on its current plan until it
comes. Beside steps whose threads want every core it got none: on the development machine a plan of
1.65 s alone did not come back in 28.5 s of decode steps on both cores (``benchmarks.plan_beside_steps``),
and on the H100 machine
(session 43, ``docs/logs-run43/load_beside_call1.log``) a calibration's plan for llama3-8b at 8 GiB,
asked for while the steps computed on all 16 cores, had not come back two minutes later. So while
the child makes a plan, the steps compute on one thread fewer
(:meth:`~vramshard.runtime.executor.Executor.spare_a_core`, from :func:`planning`): a core for the
child, a sixteenth of the CPU work's threads for the second or two of the plan.

Requests and answers cross the child's stdin and stdout as lines of JSON
(:mod:`~vramshard.runtime.plan_wire`: no pickles); the child builds the model again from the
config.json dict it was built from, and a model without one is planned on the calling thread. A child that has not answered in ``ANSWER_S`` is killed. A child that fails is
replaced once; when none can be started or the replacement fails too, plans are made on the calling
thread again, with a warning, for the rest of the process (``VRAMSHARD_PLAN_PROCESS=off``: always).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

from ..env import switch
from ..errors import VramshardError
from ..models.base import Model
from ..plan.mechanisms import fixed_mechanisms
from ..plan.planner import PlanSet
from . import plan_wire
from .budget import PlanSettings, make_plan
from .plan_wire import WireError

log = logging.getLogger(__name__)

ENABLED = switch("VRAMSHARD_PLAN_PROCESS", default=True)
IDLE_EXIT_S = 300.0  # a child without requests this long is stopped
ANSWER_S = 300.0  # a child that has not answered a request in this long is killed (a full plan takes seconds)


class PlanProcessError(VramshardError):
    """The planning process could not be started, or failed outside the planner."""


class NotBuildable(PlanProcessError):
    """A model the planning process cannot build again (not built from a config.json dict): its
    plans are made on the calling thread, and the process stays on for other models."""


def _send(stream, message: dict) -> None:
    stream.write(plan_wire.dumps(message))
    stream.flush()


def _receive(stream) -> dict:
    """The next message on ``stream``; EOFError at its end."""
    line = stream.readline()
    if not line.endswith(b"\n"):
        raise EOFError("the stream ended" + (" inside a message" if line else ""))
    return plan_wire.loads(line)


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
        self.asking = 0  # requests in flight (one served at a time; the others wait for the lock)
        self._counting = threading.Lock()

    def make_plan(self, model: Model, settings: PlanSettings, budget: int | None, kv_on_gpu: bool | None = None,
                  search: bool = True) -> PlanSet:
        """:func:`~vramshard.runtime.budget.make_plan` in the child, pricing this process's mechanisms.
        A planner's error (a BudgetError) is raised here as it was there; PlanProcessError when the
        child cannot be started or does not answer."""
        recipe = plan_wire.model_recipe(model)
        if recipe is None:
            raise NotBuildable("the model was not built from a config.json dict: the planning process "
                               "cannot build it")
        request = plan_wire.request(recipe, settings, budget, kv_on_gpu, search, settings.mechanisms())
        with self._counting:
            self.asking += 1
        try:
            with self._lock:
                if self._idle is not None:
                    self._idle.cancel()
                answer = self._ask(request, retry=self._child is not None)
                self._idle = threading.Timer(self.idle_exit_s, self._stop_if_idle)
                self._idle.daemon = True
                self._idle.start()
        finally:
            with self._counting:
                self.asking -= 1
        if not answer.get("ok"):
            raise plan_wire.error_from_wire(answer)
        plan = plan_wire.plan_from_wire(answer["plan"])
        self.plans += 1
        return plan

    def _ask(self, request: dict, retry: bool) -> dict:
        """The child's answer (a plan or an error) (started here if none runs; killed when it has not
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
        except (OSError, EOFError, WireError) as exc:
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
        self._child = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE,
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


# The child's program: the idle scheduling class first (before torch's import, a second of a core),
# then this module's _serve.
_CHILD = ("import os, runpy\n"
          "try:\n    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"
          "except (AttributeError, OSError):\n    os.nice(19)\n"  # (not Linux, or refused: the lowest priority)
          f"runpy.run_module({__name__!r}, run_name='__main__')\n")


_shared: PlanProcess | None = None
_shared_lock = threading.Lock()
_failed: str | None = None  # why plans are made on the calling thread for the rest of the process


def planning() -> bool:
    """Whether this process's planning process is making a plan now (the steps leave it a core then:
    :meth:`~vramshard.runtime.executor.Executor.spare_a_core`)."""
    process = _shared
    return process is not None and process.asking > 0


def child_pids() -> list[int]:
    """The planning process's pid where it runs (its CPU time is this process's work, not the load beside
    it: :mod:`~vramshard.runtime.host_load`)."""
    process = _shared
    child = process._child if process is not None else None
    return [child.pid] if child is not None and child.poll() is None else []


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
        except NotBuildable:
            log.debug("%s: planned on this thread (not built from a config.json dict)", settings.name)
            return make_plan(model, settings, budget, kv_on_gpu, search)
        except (PlanProcessError, WireError) as exc:
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
            message = _receive(requests)
        except EOFError:
            return
        try:
            model, settings, budget, kv_on_gpu, search, mechanisms = plan_wire.read_request(message)
            with fixed_mechanisms(mechanisms):
                reply = {"ok": True, "plan": plan_wire.plan_to_wire(make_plan(model, settings, budget, kv_on_gpu,
                                                                               search))}
        except Exception as exc:  # the planner's errors go back to be raised there
            reply = {"ok": False, **plan_wire.error_to_wire(exc)}
        try:
            _send(replies, reply)
        except BrokenPipeError:  # the engine's process ended while this plan was made: nobody to answer
            return


if __name__ == "__main__":
    _serve()
