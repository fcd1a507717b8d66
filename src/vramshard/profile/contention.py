"""Background load for the contention measurements.

The CPU and the copy engine share the host memory controller, so each slows the other.
``pcie_load`` keeps the copy engine streaming host→device while the CPU is measured;
``cpu_load`` keeps the CPU thread pool reading host memory as a decode step's CPU work does (one-row
products over weights that do not fit in the cache) while PCIe is measured.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass
class LoadRate:
    """What a background load achieved while it ran (filled in when the ``with`` block ends)."""

    nbytes: int = 0
    seconds: float = 0.0

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds else 0.0


@contextlib.contextmanager
def pcie_load(nbytes: int = 256 * 2**20, depth: int = 3):
    """While inside: the copy engine streams ``nbytes`` pinned host→device over and over, without a gap.

    A background thread keeps ``depth`` batches of four copies queued, and sleeps on the oldest
    batch. The copy engine never waits for the thread, which may not get a core for a while
    beside a matmul on every core. A load that the thread re-issues only after each batch
    ends leaves the copy engine idle during those waits, and then the CPU is measured with
    less contention than a step has. Yields a :class:`LoadRate` with the bytes copied and the
    seconds taken, for the profile to record what load the CPU was measured under.
    """
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    copy_stream = torch.cuda.Stream()
    queued: deque = deque()  # blocking events, one per queued batch, oldest first
    rate = LoadRate()

    def copies() -> None:
        # A blocking-sync event sleeps until the copies finish. ``Stream.synchronize`` would spin a
        # core at 100%, and one spinning core beside a matmul on every core stalls the whole
        # thread pool at each barrier (measured: CPU matmul 5x slower), which the executor never
        # does: it issues copies asynchronously from the thread that computes.
        with torch.cuda.stream(copy_stream):
            while len(queued) < depth:
                for _ in range(4):
                    dst.copy_(src, non_blocking=True)
                done = torch.cuda.Event(blocking=True)
                done.record(copy_stream)
                queued.append(done)
                rate.nbytes += 4 * nbytes
        queued.popleft().synchronize()  # sleeps, and releases the GIL, while the copies run

    start = time.perf_counter()
    with _background("PCIe background load", copies):
        yield rate
    copy_stream.synchronize()
    rate.seconds = time.perf_counter() - start
    torch.cuda.synchronize()


@contextlib.contextmanager
def cpu_load(k: int = 4096, n: int = 14336, dtype: str = "bf16"):
    """While inside: a background thread runs one-row products ``linear(x[1, k], W[n, k])`` on the torch
    CPU pool, each over the next of copies of ``W`` that together pass the last-level cache
    (:func:`~vramshard.profile.bench_matmul.cold_copies`): the CPU's work at decode, which reads
    every weight from memory once. Yields a :class:`LoadRate` with the weight bytes it read and the
    seconds taken.

    Until session 53 this was an fp32 ``[16, 4096] @ [4096, 14336]`` over one weight of 235 MB: the H100
    and H200 profiles priced host→device copies beside it at their alone rate (55 GB/s). On an H100 machine
    (``benchmarks.copy_contention``, docs/BENCHMARKS.md, forty-eighth GPU session) copies ran 0.4-0.8%
    slower beside that load (22.8 GB/s of weight read) and 8-10% slower beside this one (92.1 GB/s read),
    near the 48.9 GB/s they kept beside the CPU summing memory.
    """
    import torch

    from .bench_matmul import cold_copies, linear_over
    from .spec import torch_dtype

    torch_dt = torch_dtype(dtype)
    weights = cold_copies(torch.randn(n, k, dtype=torch_dt) * 0.02)  # [N, K] each
    product = linear_over(torch.randn(1, k, dtype=torch_dt), weights)  # x: [1, K]
    rate = LoadRate()

    def read_one() -> None:
        product()  # releases the GIL in the kernel
        rate.nbytes += weights[0].nbytes

    start = time.perf_counter()
    with _background("CPU background load", read_one):
        yield rate
    rate.seconds = time.perf_counter() - start


@contextlib.contextmanager
def _background(what: str, work):
    """Run ``work()`` over and over on a daemon thread while inside; re-raise its first error after."""
    import torch

    stop = threading.Event()
    errors: list[BaseException] = []

    def loop() -> None:
        # inference_mode is per thread; the buffers may be inference tensors.
        with _recording(errors), torch.inference_mode():
            while not stop.is_set():
                work()

    worker = threading.Thread(target=loop, name=f"vramshard-{what.split()[0].lower()}-load", daemon=True)
    worker.start()
    try:
        yield
    finally:
        stop.set()
        worker.join()
    _raise_first(errors, what)


@contextlib.contextmanager
def _recording(errors: list):
    try:
        yield
    except BaseException as exc:  # noqa: BLE001 - handed to the main thread
        errors.append(exc)


def _raise_first(errors: list, what: str) -> None:
    if errors:
        raise RuntimeError(f"{what} failed, so the contention measurement is invalid") from errors[0]
