"""A background thread that runs scheduler steps while there is work.

    loop = EngineLoop(engine.scheduler(max_seqs=8))
    handle = loop.submit(prompt_ids, SamplingParams(), max_new_tokens=64)
    for output in handle:              # from any thread; or `async for` inside asyncio
        print(output.text, end="")
    loop.close()

A :class:`RequestHandle` receives the request's :class:`RequestOutput` objects from the engine
thread: into a thread-safe queue (sync iteration), or, when submitted from a running asyncio
event loop, into an ``asyncio.Queue`` through ``loop.call_soon_threadsafe`` (async iteration).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import AsyncIterator, Iterator, Sequence

from .request import Request, RequestOutput
from .sampler import SamplingParams
from .scheduler import Scheduler

log = logging.getLogger(__name__)


class RequestHandle:
    """The consumer's end of one request: iterate its outputs (sync or async), cancel it."""

    def __init__(self, owner: "EngineLoop", loop: asyncio.AbstractEventLoop | None):
        self._owner = owner
        self._loop = loop
        self._queue: queue.Queue | None = None if loop else queue.Queue()
        self._aqueue: asyncio.Queue | None = asyncio.Queue() if loop else None
        self.request: Request | None = None

    @property
    def request_id(self) -> int:
        return self.request.request_id

    @property
    def finished(self) -> bool:
        return self.request is not None and self.request.is_finished

    def cancel(self) -> None:
        """End the request; its KV slot is freed at the next step boundary."""
        self._owner.cancel(self)

    def _deliver(self, output: RequestOutput) -> None:  # on the engine thread
        if self._loop is None:
            self._queue.put(output)
            return
        try:
            self._loop.call_soon_threadsafe(self._aqueue.put_nowait, output)
        except RuntimeError:  # the consumer's event loop is closed: nobody is listening any more
            self.request.cancel()

    def __iter__(self) -> Iterator[RequestOutput]:
        if self._queue is None:
            raise TypeError("this request was submitted from an asyncio loop; use `async for`")
        while True:
            output = self._queue.get()
            yield output
            if output.finished:
                return

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        if self._aqueue is None:
            raise TypeError("this request was submitted outside an asyncio loop; use a plain `for`")
        return self._aiter()

    async def _aiter(self) -> AsyncIterator[RequestOutput]:
        while True:
            output = await self._aqueue.get()
            yield output
            if output.finished:
                return

    def result(self) -> Request:
        """Wait (sync) until the request ends; returns the finished :class:`Request`."""
        for _ in self:
            pass
        return self.request

    async def aresult(self) -> Request:
        """Wait (async) until the request ends; returns the finished :class:`Request`."""
        async for _ in self:
            pass
        return self.request


class EngineLoop:
    """Runs ``scheduler`` on a daemon thread; :meth:`submit` and :meth:`cancel` are safe from any thread."""

    def __init__(self, scheduler: Scheduler, name: str = "vramshard-engine"):
        self.scheduler = scheduler
        self.failed_steps = 0
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams | None = None, max_new_tokens: int = 128,
               stop: Sequence[str] | None = None, loop: asyncio.AbstractEventLoop | None = None,
               multimodal=None) -> RequestHandle:
        """Queue a prompt. ``loop``: deliver outputs to this asyncio loop (default: the running one,
        if called from a coroutine; otherwise a thread-safe queue). ``multimodal``: a prompt's images
        (see :meth:`Scheduler.add`). Raises InvalidInputError for a request that cannot run."""
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
        handle = RequestHandle(self, loop)
        handle.request = self.scheduler.add(prompt_ids, params, max_new_tokens, stop, on_output=handle._deliver,
                                            multimodal=multimodal)
        self._wake.set()
        return handle

    def cancel(self, handle: RequestHandle) -> None:
        """Cancel a submitted request (a no-op once it has finished)."""
        if handle.request is not None and not handle.request.is_finished:
            handle.request.cancel()
            self._wake.set()

    def stats(self) -> dict:
        """The scheduler's counters plus whether the engine thread is alive."""
        return {**self.scheduler.stats(), "engine_alive": self.alive, "failed_steps": self.failed_steps}

    def close(self, timeout: float | None = 10.0) -> None:
        """Stop the thread after the current step; requests still queued or running are cancelled."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        scheduler = self.scheduler
        for request in list(scheduler.waiting) + list(scheduler.running) + list(scheduler._incoming):
            request.cancel()
        if not self._thread.is_alive():
            scheduler._take_incoming()
            scheduler._retire_cancelled()

    def _run(self) -> None:
        scheduler = self.scheduler
        while not self._stopping:
            if not scheduler.has_work:
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                stats = scheduler.step()
            except Exception:  # the scheduler already ended the step's requests with the error
                self.failed_steps += 1
                log.exception("engine step failed")
                continue
            if stats is None:  # work that cannot run yet (nothing admitted): don't spin
                self._wake.wait(0.01)
                self._wake.clear()
