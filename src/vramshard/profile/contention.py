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
    stop = threading.Event()
    copy_stream = torch.cuda.Stream()

    errors: list[BaseException] = []

    def stream_copies() -> None:
        # inference_mode is per thread; the buffers may be inference tensors.
        with _recording(errors), torch.inference_mode(), torch.cuda.stream(copy_stream):
            while not stop.is_set():
                for _ in range(4):
                    dst.copy_(src, non_blocking=True)
                copy_stream.synchronize()  # releases the GIL while the copies run

    worker = threading.Thread(target=stream_copies, name="vramshard-pcie-load", daemon=True)
    worker.start()
    try:
        yield
    finally:
        stop.set()
        worker.join()
        torch.cuda.synchronize()
    _raise_first(errors, "PCIe background load")


@contextlib.contextmanager
def cpu_load(m: int = 16, k: int = 4096, n: int = 14336):
    """While inside: a background thread runs fp32 ``[m, k] @ [k, n]`` on the torch CPU pool."""
    import torch
    import torch.nn.functional as F

    x = torch.randn(m, k)  # [M, K]
    weight = torch.randn(n, k)  # [N, K], as nn.Linear stores it
    stop = threading.Event()

    errors: list[BaseException] = []

    def compute() -> None:
        with _recording(errors), torch.inference_mode():
            while not stop.is_set():
                F.linear(x, weight)  # releases the GIL inside the kernel

    worker = threading.Thread(target=compute, name="vramshard-cpu-load", daemon=True)
    worker.start()
    try:
        yield
    finally:
        stop.set()
        worker.join()
    _raise_first(errors, "CPU background load")


@contextlib.contextmanager
def _recording(errors: list):
    try:
        yield
    except BaseException as exc:  # noqa: BLE001 - handed to the main thread
        errors.append(exc)


def _raise_first(errors: list, what: str) -> None:
    if errors:
        raise RuntimeError(f"{what} failed, so the contention measurement is invalid") from errors[0]
