"""Words in pinned host memory that a CUDA stream writes and waits for: the driver's stream
memory operations (``cuStreamWriteValue64``, ``cuStreamWaitValue64``), called through ``ctypes``.

The run-ahead worker (:mod:`~vramshard.runtime.run_ahead`) polls a *ready* word that the stream
writes once a CPU part's input has landed, and raises a *ticket* word when the part is done; the
stream must not go past the part's copy before that. Operations on the stream itself occupy no SM
and are what CUDA provides for it (``VRAMSHARD_RUN_AHEAD_WAIT=stream``); the default is one-thread
Triton kernels doing the same.
"""

from __future__ import annotations

import ctypes
import sys

import torch

_WAIT_VALUE_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: until *addr >= value (unsigned)
_WRITE_VALUE_DEFAULT = 0x0  # after the work before it, with a memory barrier


def _driver() -> ctypes.CDLL:
    """The CUDA driver library (the one torch has loaded)."""
    return ctypes.WinDLL("nvcuda.dll") if sys.platform == "win32" else ctypes.CDLL("libcuda.so.1")


def _entry(lib: ctypes.CDLL, *names: str):
    for name in names:
        entry = getattr(lib, name, None)
        if entry is not None:
            return entry
    raise OSError(f"the CUDA driver has none of {', '.join(names)}")


class StreamWords:
    """Stream operations on two 64-bit words in pinned host memory: write ``ready`` once the work
    queued before is done, wait until ``ticket`` reaches a number.

    The stream stalls on the GPU's front end, not in a kernel; the host does not block. Raises
    OSError / RuntimeError when made where the driver cannot do it."""

    def __init__(self, ready: torch.Tensor, ticket: torch.Tensor):
        for word in (ready, ticket):
            if not (word.is_pinned() and word.dtype == torch.int64 and word.numel() == 1):
                raise ValueError("each word must be one pinned int64")
        lib = _driver()
        self._write = _entry(lib, "cuStreamWriteValue64_v2", "cuStreamWriteValue64")
        self._wait = _entry(lib, "cuStreamWaitValue64_v2", "cuStreamWaitValue64")
        for entry in (self._write, self._wait):
            entry.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
            entry.restype = ctypes.c_int
        self._device_pointer = _entry(lib, "cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer")
        self._device_pointer.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
        self._device_pointer.restype = ctypes.c_int
        self.words = (ready, ticket)  # kept alive with their addresses
        self._ready, self._ticket = self._address(ready), self._address(ticket)
        self.write_ready(0)  # first operations, already met: fail here, not mid-step
        self.wait_ticket(0)
        torch.cuda.current_stream().synchronize()

    def write_ready(self, number: int, stream: torch.cuda.Stream | None = None) -> None:
        """On ``stream`` (the current one by default), write ``number`` into the ready word."""
        self._check(self._write(self._handle(stream), self._ready, number, _WRITE_VALUE_DEFAULT),
                    "cuStreamWriteValue64")

    def wait_ticket(self, number: int, stream: torch.cuda.Stream | None = None) -> None:
        """On ``stream`` (the current one by default), wait until the ticket is at least ``number``."""
        self._check(self._wait(self._handle(stream), self._ticket, number, _WAIT_VALUE_GEQ),
                    "cuStreamWaitValue64")

    def _address(self, word: torch.Tensor) -> int:
        address = ctypes.c_uint64()
        self._check(self._device_pointer(ctypes.byref(address), ctypes.c_void_p(word.data_ptr()), 0),
                    "cuMemHostGetDevicePointer")
        return address.value

    @staticmethod
    def _handle(stream: torch.cuda.Stream | None) -> ctypes.c_void_p:
        return ctypes.c_void_p((stream if stream is not None else torch.cuda.current_stream()).cuda_stream)

    @staticmethod
    def _check(result: int, what: str) -> None:
        if result != 0:
            raise RuntimeError(f"{what} failed with CUresult {result}")
