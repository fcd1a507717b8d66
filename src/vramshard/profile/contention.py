"""Background load for the contention measurements.

The CPU and the copy engine share the host memory controller, so each slows the other.
``pcie_load`` keeps the copy engine streaming host→device while the CPU is measured;
``cpu_load`` keeps the CPU thread pool busy with a memory-bound matmul (a decode-time FFN
on the CPU, the case that overlaps with streaming) while PCIe is measured.
"""

from __future__ import annotations

import contextlib
import logging
import threading

log = logging.getLogger(__name__)


@contextlib.contextmanager
def pcie_load(nbytes: int = 256 * 2**20):
    """While inside: a background thread copies ``nbytes`` pinned host→device, over and over."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    copy_stream = torch.cuda.Stream()
    # A blocking-sync event sleeps until the copies finish. ``Stream.synchronize`` would spin a
    # core at 100%, and one spinning core beside a matmul on every core stalls the whole
    # thread pool at each barrier (measured: CPU matmul 5x slower), which the executor never
    # does: it issues copies asynchronously from the thread that computes.
    done = torch.cuda.Event(blocking=True)

    def copies() -> None:
        with torch.cuda.stream(copy_stream):
            for _ in range(4):
                dst.copy_(src, non_blocking=True)
            done.record(copy_stream)
        done.synchronize()  # sleeps, and releases the GIL, while the copies run

    with _background("PCIe background load", copies):
        yield
    torch.cuda.synchronize()


@contextlib.contextmanager
def cpu_load(m: int = 16, k: int = 4096, n: int = 14336):
    """While inside: a background thread runs fp32 ``[m, k] @ [k, n]`` on the torch CPU pool."""
    import torch
    import torch.nn.functional as F

    x = torch.randn(m, k)  # [M, K]
    weight = torch.randn(n, k)  # [N, K], as nn.Linear stores it
    with _background("CPU background load", lambda: F.linear(x, weight)):  # releases the GIL in the kernel
        yield


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
