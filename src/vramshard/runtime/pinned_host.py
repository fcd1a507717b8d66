"""Page-locked (pinned) host buffers of exactly the size asked for.

The problem: ``torch.empty(n, pin_memory=True)`` goes through PyTorch's CachingHostAllocator,
which rounds every request up to the next power of two (pytorch/pytorch PR #171662; vLLM issue
#56410, "--cpu-offload-gb uses ~1.9x the host memory it asks for"; sglang PR #36562 fixed the
same with mmap + cudaHostRegister). The host weights are one pinned buffer per sub-layer
(:mod:`~vramshard.runtime.host_weights`): for Llama-3-8B in bfloat16 a dense FFN's 352 MB pins
512 MB and an attention block's 84 MB pins 128 MB, so the whole model pins about 1.47x its bytes
of host RAM, gigabytes that nothing uses on the 16-32 GB desktops this engine is for.

The mechanism: :func:`pinned_empty` maps private anonymous memory (``mmap``: page-aligned by
construction, its size rounded up to a page only; advised to take 2 MiB pages, and kept out of forked
children), wraps it with ``torch.frombuffer`` and
page-locks it with ``cudaHostRegister`` (flags Portable | Mapped: pinned for every CUDA context,
and mapped into the GPU's address space, where with unified addressing the device pointer is the
host pointer; :mod:`~vramshard.runtime.zero_copy_experts` has Triton kernels read host experts
that way). The tensor returned is that buffer sliced to the bytes asked for. Where registration
fails, torch's pinned allocator is the fallback, then pageable memory, each with one warning.

The lifetime: ``torch.frombuffer`` takes a reference to the map object, which the tensor's
storage drops when the storage is freed; every view and slice of the tensor shares that one
storage, so the storage (and with it the reference) goes only after the last view is gone. The map
is referenced by nothing else, so its ``__del__`` runs exactly once, then, and unregisters the
memory before the base class unmaps it: no view can outlive the registration, and the pointer is
never unregistered twice. (``frombuffer`` holds no buffer export, so ``close()`` would unmap under
a live tensor; the map is never handed out, so nothing calls it.) Unlike torch's allocator, no
CUDA event keeps a freed buffer alive until copies queued from it have run: holders keep the
tensor until their copies are done (the host weights live as long as their engine).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os

import torch

from ..env import choice, switch

log = logging.getLogger(__name__)

EXACT = switch("VRAMSHARD_EXACT_PIN", default=True)  # off: torch's (power-of-two) pinned allocator
# huge: 2 MiB pages asked for (session 36); small: 4 KiB pages. The GPU's zero-copy expert reads go as fast
# from either (33.5-34.5 GB/s on the H100 machine, thirty-third GPU session); the CPU reads 2 MiB pages faster.
HOST_PAGES = choice("VRAMSHARD_HOST_PAGES", ("huge", "small"), "huge")

PAGE = mmap.PAGESIZE
PRIVATE_MAPS = hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS")  # (POSIX)
REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, not only the current one
REGISTER_MAPPED = 2  # cudaHostRegisterMapped: GPU kernels may read it in place (zero-copy experts)
REGISTER_FLAGS = REGISTER_PORTABLE | REGISTER_MAPPED

_register_warned = False
_pin_warned = False


class _RegisteredMap(mmap.mmap):
    """Anonymous memory that, once registered with CUDA, unregisters itself before it is unmapped."""

    _cudart = None  # the bindings that registered it (None: not registered)
    _ptr = 0

    def __del__(self):
        if self._cudart is not None:
            cudart, self._cudart = self._cudart, None
            try:
                cudart.cudaHostUnregister(self._ptr)
            except Exception:  # interpreter shutdown: the CUDA bindings may be torn down already
                pass


def host_empty(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 CPU tensor of exactly ``nbytes`` in pageable memory backed by 2 MiB pages
    where the kernel gives them (see :func:`_anonymous`): the host weights of a CPU-only engine.
    ``torch.empty`` where the platform has no such mapping."""
    if nbytes <= 0 or not PRIVATE_MAPS:
        return torch.empty(max(nbytes, 0), dtype=torch.uint8)
    return torch.frombuffer(_anonymous(mmap.mmap, nbytes), dtype=torch.uint8)[:nbytes]


def _anonymous(kind: type, nbytes: int) -> mmap.mmap:
    """A private anonymous mapping of ``nbytes`` (rounded up to a page) of class ``kind``, advised to take
    2 MiB pages before its first touch (a shared one where the platform has no private maps). A decode
    step streams its weights from these buffers, and with 4 KiB pages the CPU's TLB misses on every
    page: on the development machine an 8B model's FFN weight read at 30.7 GB/s by the C kernel and
    30.0 GB/s by ``torch.sum`` on 2 MiB pages, against 27.3 and 18.2 from ``torch.empty`` and 30.0 and
    24.8 from a shared map (``python -m benchmarks.host_pages``, session 36). Shared anonymous maps
    (``mmap``'s default, used here until session 36) are shared memory, which most kernels give no
    large pages (``shmem_enabled`` ``never``). ``VRAMSHARD_HOST_PAGES=small`` asks for 4 KiB pages instead."""
    size = -(-nbytes // PAGE) * PAGE
    memory = kind(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) if PRIVATE_MAPS else kind(-1, size)
    advice = getattr(mmap, "MADV_HUGEPAGE" if HOST_PAGES == "huge" else "MADV_NOHUGEPAGE", None)
    if advice is not None:
        try:
            memory.madvise(advice)
        except OSError:  # (a kernel without transparent huge pages: 4 KiB pages)
            pass
    return memory


def pinned_empty(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 CPU tensor of exactly ``nbytes``, page-locked without torch's
    power-of-two rounding (see the module docstring).

    Plain (pageable) memory where there is nothing to pin for: ``nbytes == 0`` or no CUDA. With
    ``VRAMSHARD_EXACT_PIN=off``, or where ``cudaHostRegister`` fails (warned once, with the size
    and the CUDA error), torch's pinned allocator; where that fails too, pageable memory (warned
    once: copies from it to the GPU are slower).
    """
    if nbytes < 0:
        raise ValueError(f"cannot allocate {nbytes} bytes of host memory: the size must be at least 0")
    if nbytes == 0 or not torch.cuda.is_available():
        return host_empty(nbytes)
    if EXACT:
        tensor = _registered(nbytes)
        if tensor is not None:
            return tensor
    return _torch_pinned(nbytes)


def pinned_exact_or_pageable(nbytes: int) -> torch.Tensor:
    """Like :func:`pinned_empty`, but never from torch's pinned allocator, which rounds a buffer up to a power of two
    (a 9 GiB KV cache would pin 16): page-locked by ``cudaHostRegister`` where it takes it, else pageable memory
    (the caller's copies then go another way)."""
    if nbytes < 0:
        raise ValueError(f"cannot allocate {nbytes} bytes of host memory: the size must be at least 0")
    if nbytes == 0 or not torch.cuda.is_available() or not EXACT:
        return host_empty(nbytes)
    tensor = _registered(nbytes, instead="pageable memory")
    return tensor if tensor is not None else host_empty(nbytes)


def _registered(nbytes: int, instead: str = "torch's allocator, which rounds each buffer up to a power of two"
                ) -> torch.Tensor | None:
    """``nbytes`` of mapped memory registered with CUDA, or None (warned once, saying what the caller takes
    ``instead``) where that failed."""
    global _register_warned
    size = -(-nbytes // PAGE) * PAGE
    memory = _anonymous(_RegisteredMap, size)  # (advised before registration faults every page in)
    if hasattr(mmap, "MADV_DONTFORK"):
        # A private map's pages turn copy-on-write in a forked child, and a write before its exec would move
        # the parent's page away from the one the GPU reads: no child gets these pages at all.
        try:
            memory.madvise(mmap.MADV_DONTFORK)
        except OSError:
            pass
    whole = torch.frombuffer(memory, dtype=torch.uint8)  # holds a reference to `memory`
    ptr = whole.data_ptr()
    try:
        cudart = torch.cuda.cudart()
        error = cudart.cudaHostRegister(ptr, size, REGISTER_FLAGS)
    except (AssertionError, AttributeError, RuntimeError) as exc:  # no runtime bindings in this build
        cudart, error = None, exc
    code = _code(error)
    if code == 0:
        memory._ptr, memory._cudart = ptr, cudart
        return whole[:nbytes]
    if cudart is not None:
        _clear_cuda_error()
    if not _register_warned:
        log.warning("cudaHostRegister of %d bytes failed (%s); taking %s instead (VRAMSHARD_EXACT_PIN=off skips "
                    "trying)", size, _describe(cudart, error), instead)
        _register_warned = True
    return None


def _torch_pinned(nbytes: int) -> torch.Tensor:
    """``nbytes`` from torch's pinned allocator, or pageable memory (warned once) where pinning fails."""
    global _pin_warned
    try:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    except RuntimeError as exc:
        if not _pin_warned:
            log.warning("cannot pin host memory (%s); streaming falls back to pageable memory, "
                        "which is slower", exc)
            _pin_warned = True
    return torch.empty(nbytes, dtype=torch.uint8)


def _code(error) -> int | None:
    """A CUDA error as an int (torch's binding returns a pybind11 enum, with ``.value``); None
    where the call raised instead of returning one."""
    if isinstance(error, BaseException):
        return None
    return int(getattr(error, "value", error))


def _describe(cudart, error) -> str:
    if isinstance(error, BaseException):
        return f"no CUDA runtime bindings: {error}"
    code = _code(error)
    try:
        return f"CUDA error {code}: {cudart.cudaGetErrorString(error)}"
    except Exception:  # an error code that the bindings' enum cannot name
        return f"CUDA error {code}"


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a failed registration. Torch's binding returns the
    error but leaves it latched, and the next checked kernel launch (``cudaGetLastError``) would
    raise it as its own. Torch binds no ``cudaGetLastError``, so it is called in each libcudart
    mapped into the process (the last error is kept per runtime instance)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = cudart_paths(maps.read())
    except OSError:  # not Linux
        paths = []
    for path in paths:
        try:
            ctypes.CDLL(path).cudaGetLastError()  # already loaded: dlopen gives that instance
        except (OSError, AttributeError) as exc:
            log.debug("cannot reset the last CUDA error in %s: %s", path, exc)


def cudart_paths(maps: str) -> list[str]:
    """The distinct CUDA runtime libraries in a ``/proc/self/maps`` text, in order of appearance:
    ``libcudart.so.13``, or a wheel's bundled ``libcudart-<hash>.so.12``."""
    paths = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6:
            continue
        path = fields[5].removesuffix(" (deleted)")
        if os.path.basename(path).startswith("libcudart") and path not in paths:
            paths.append(path)
    return paths
