"""Pinned host buffers of exactly the size asked for (runtime/pinned_host.py).

Without a GPU the CUDA runtime is a fake that records registrations; the GPU test pins for real.
"""

import gc
import logging
import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vramshard.runtime import host_weights, pinned_host
from vramshard.runtime.pinned_host import PAGE, pinned_empty

NBYTES = 3 * PAGE + 123  # not a multiple of the page: the map is 4 pages


class FakeCudart:
    """Records cudaHostRegister / cudaHostUnregister; returns ``error`` from the registration."""

    def __init__(self, error=0):
        self.error = error
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr, size, flags):
        self.registered.append((ptr, size, flags))
        return self.error

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        return 0

    def cudaGetErrorString(self, error):
        return "fake failure"


class FakeEnum:
    """Like the pybind11 enum torch's binding returns: an int behind ``.value``."""

    def __init__(self, value):
        self.value = value


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA 'available', with a fake runtime; warnings not yet given; the error reset recorded."""
    cudart = FakeCudart()
    cudart.cleared = 0

    def clear():
        cudart.cleared += 1

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(pinned_host, "EXACT", True)
    monkeypatch.setattr(pinned_host, "_register_warned", False)
    monkeypatch.setattr(pinned_host, "_pin_warned", False)
    monkeypatch.setattr(pinned_host, "_clear_cuda_error", clear)
    return cudart


def _fill(tensor: torch.Tensor) -> torch.Tensor:
    """Write a pattern into ``tensor`` in place; returns a copy of what was written."""
    pattern = (torch.arange(tensor.numel(), dtype=torch.int64) % 251).to(torch.uint8)
    tensor.copy_(pattern)
    return pattern


def test_without_cuda_plain_memory_of_exact_size(monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: asked.append("cudart") or FakeCudart())
    plain = lambda n: asked.append("torch") or torch.empty(n, dtype=torch.uint8)  # noqa: E731
    monkeypatch.setattr(pinned_host, "_torch_pinned", plain)
    tensor = pinned_empty(NBYTES)
    assert asked == []  # neither the CUDA runtime nor torch's pinned allocator
    assert tensor.dtype == torch.uint8 and tensor.device.type == "cpu"
    assert tensor.shape == (NBYTES,)
    pattern = _fill(tensor)
    assert torch.equal(tensor, pattern)


def _mapping_flags(tensor: torch.Tensor) -> tuple[str, str]:
    """(permissions, VmFlags) of the mapping that holds ``tensor``'s first byte (/proc/self/smaps)."""
    address, perms, flags = tensor.data_ptr(), None, None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and all(c in "0123456789abcdef-" for c in head[0]):
                start, end = (int(a, 16) for a in head[0].split("-"))
                perms = head[1] if start <= address < end else None
            elif line.startswith("VmFlags:") and perms is not None:
                flags = line.split(":", 1)[1].split()
                return perms, flags
    raise AssertionError("the tensor's mapping is not in /proc/self/smaps")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
@pytest.mark.parametrize("where", ["host_empty", "pinned"])
def test_host_buffers_are_private_maps_advised_to_take_huge_pages(fake_cuda, where):
    """The host weights' buffers, pageable (a CPU-only engine) or registered with CUDA, are private
    anonymous maps advised to take 2 MiB pages before their first touch: a shared one (mmap's default)
    is shared memory, which most kernels back with 4 KiB pages only, and streaming weights then misses
    the TLB on every page (on the development machine torch.sum read 18.9 against 29.6 GB/s)."""
    nbytes = 8 * 2**20 + 5
    tensor = pinned_host.host_empty(nbytes) if where == "host_empty" else pinned_empty(nbytes)
    assert tensor.shape == (nbytes,) and tensor.dtype == torch.uint8
    pattern = _fill(tensor)
    assert torch.equal(tensor, pattern)
    perms, flags = _mapping_flags(tensor)
    assert perms.endswith("p")  # private, not shared ("s")
    if hasattr(mmap, "MADV_HUGEPAGE") and Path("/sys/kernel/mm/transparent_hugepage/enabled").exists():
        assert "hg" in flags  # MADV_HUGEPAGE
    assert len(fake_cuda.registered) == (1 if where == "pinned" else 0)
    if where == "pinned" and hasattr(mmap, "MADV_DONTFORK"):
        assert "dc" in flags  # (no forked child gets the pages the GPU reads)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
@pytest.mark.parametrize("where", ["host_empty", "pinned"])
def test_small_pages_when_asked(fake_cuda, monkeypatch, where):
    """``VRAMSHARD_HOST_PAGES=small``: the same private maps, advised to keep 4 KiB pages (to compare the
    GPU's zero-copy reads from both kinds)."""
    monkeypatch.setattr(pinned_host, "HOST_PAGES", "small")
    tensor = pinned_host.host_empty(8 * 2**20) if where == "host_empty" else pinned_empty(8 * 2**20)
    perms, flags = _mapping_flags(tensor)
    assert perms.endswith("p") and "hg" not in flags
    if hasattr(mmap, "MADV_NOHUGEPAGE") and Path("/sys/kernel/mm/transparent_hugepage/enabled").exists():
        assert "nh" in flags  # MADV_NOHUGEPAGE


def test_a_cpu_engines_host_weights_are_on_those_maps(monkeypatch):
    """pack_model without pinning (a CPU-only engine) puts each sub-layer's weights in host_empty's maps."""
    made = []
    real = pinned_host.host_empty
    monkeypatch.setattr(host_weights, "host_empty", lambda n: made.append(n) or real(n))
    from vramshard.shapes import random_weights, shape_model

    model = shape_model("tiny-llama")
    packed = host_weights.pack_model(list(model), random_weights(model, 0), pin=False)
    assert sorted(made) == sorted(p.buffer.numel() for p in packed.values() if p.buffer.numel())


def test_zero_bytes_registers_nothing(fake_cuda):
    tensor = pinned_empty(0)
    assert tensor.shape == (0,) and tensor.dtype == torch.uint8
    assert fake_cuda.registered == []


def test_negative_size_is_an_error(fake_cuda):
    with pytest.raises(ValueError, match="-1 bytes"):
        pinned_empty(-1)


def test_registered_exact_size_page_rounded_map_mapped_flags(fake_cuda):
    tensor = pinned_empty(NBYTES)
    assert tensor.shape == (NBYTES,) and tensor.dtype == torch.uint8 and tensor.device.type == "cpu"
    assert len(fake_cuda.registered) == 1
    ptr, size, flags = fake_cuda.registered[0]
    assert ptr % PAGE == 0 and ptr == tensor.data_ptr()
    assert size == 4 * PAGE  # the page-rounded map, not the bytes asked for
    assert flags == 3  # cudaHostRegisterPortable | cudaHostRegisterMapped
    pattern = _fill(tensor)
    gc.collect()
    assert torch.equal(tensor, pattern)
    assert fake_cuda.unregistered == [] and fake_cuda.cleared == 0


def test_a_whole_page_is_not_rounded_further(fake_cuda):
    tensor = pinned_empty(2 * PAGE)
    assert tensor.shape == (2 * PAGE,)
    assert fake_cuda.registered[0][1] == 2 * PAGE


def test_unregistered_once_after_the_last_view(fake_cuda):
    tensor = pinned_empty(NBYTES)
    ptr = fake_cuda.registered[0][0]
    _fill(tensor)
    view = tensor[PAGE : PAGE + 100].view(torch.int32)  # a view of a slice: the same storage
    expected = tensor[PAGE : PAGE + 100].clone()
    del tensor
    gc.collect()
    assert fake_cuda.unregistered == []  # the view still reads the memory
    assert torch.equal(view.view(torch.uint8), expected)
    view.fill_(7)
    del view
    gc.collect()
    assert fake_cuda.unregistered == [ptr]
    gc.collect()
    assert fake_cuda.unregistered == [ptr]  # once


def test_failed_registration_falls_back_to_torch_with_one_warning(fake_cuda, monkeypatch, caplog):
    fake_cuda.error = FakeEnum(2)  # cudaErrorMemoryAllocation, as the binding's enum
    asked = []

    def torch_pinned(nbytes):
        asked.append(nbytes)
        return torch.zeros(nbytes, dtype=torch.uint8)

    monkeypatch.setattr(pinned_host, "_torch_pinned", torch_pinned)
    with caplog.at_level(logging.WARNING, logger=pinned_host.__name__):
        first = pinned_empty(NBYTES)
        second = pinned_empty(NBYTES)
    assert asked == [NBYTES, NBYTES]
    assert first.shape == (NBYTES,) and second.shape == (NBYTES,)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert str(4 * PAGE) in warnings[0] and "CUDA error 2" in warnings[0] and "fake failure" in warnings[0]
    assert fake_cuda.cleared == 2  # the latched CUDA error reset after each failure
    gc.collect()
    assert fake_cuda.unregistered == []  # nothing registered, nothing to unregister


def test_failed_registration_asks_torch_for_pinned_memory(fake_cuda, monkeypatch):
    fake_cuda.error = 801
    real_empty, asked = torch.empty, []

    def empty(*args, **kwargs):  # torch's pinned allocator needs CUDA: record the request, give plain memory
        asked.append(kwargs.pop("pin_memory", False))
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    tensor = pinned_empty(NBYTES)
    assert tensor.shape == (NBYTES,) and asked == [True]


def test_failed_registration_then_failed_pin_gives_pageable_memory(fake_cuda, caplog):
    """No CUDA here, so torch's own pinned allocation raises, as it does where pinning is refused."""
    fake_cuda.error = 801
    with caplog.at_level(logging.WARNING, logger=pinned_host.__name__):
        tensor = pinned_empty(NBYTES)
    assert tensor.shape == (NBYTES,) and not tensor.is_pinned()
    pattern = _fill(tensor)
    assert torch.equal(tensor, pattern)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert "CUDA error 801" in warnings[0] and "cannot pin host memory" in warnings[1]


def test_switch_off_uses_torch_allocator(fake_cuda, monkeypatch):
    monkeypatch.setattr(pinned_host, "EXACT", False)
    asked = []
    monkeypatch.setattr(pinned_host, "_torch_pinned", lambda n: asked.append(n) or torch.empty(n, dtype=torch.uint8))
    assert pinned_empty(NBYTES).shape == (NBYTES,)
    assert asked == [NBYTES] and fake_cuda.registered == []


@pytest.mark.parametrize("value, expected", [("off", False), ("on", True), (None, True)])
def test_switch_read_from_the_environment(value, expected):
    env = {k: v for k, v in os.environ.items() if k != "VRAMSHARD_EXACT_PIN"}
    if value is not None:
        env["VRAMSHARD_EXACT_PIN"] = value
    src = str(Path(pinned_host.__file__).parents[2])
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", "from vramshard.runtime import pinned_host; print(pinned_host.EXACT)"],
                         env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(expected)


def test_empty_host_pins_exactly_only_when_asked(fake_cuda):
    plain = host_weights._empty_host(NBYTES, pin=False)
    assert plain.shape == (NBYTES,) and fake_cuda.registered == []
    pinned = host_weights._empty_host(NBYTES, pin=True)
    assert pinned.shape == (NBYTES,)
    assert fake_cuda.registered == [(pinned.data_ptr(), 4 * PAGE, 3)]


def test_error_codes_as_ints():
    assert pinned_host._code(0) == 0
    assert pinned_host._code(FakeEnum(0)) == 0
    assert pinned_host._code(FakeEnum(712)) == 712
    assert pinned_host._code(RuntimeError("no bindings")) is None


def test_cudart_paths_from_maps():
    maps = "\n".join([
        "7f00-7f10 r-xp 00000000 08:01 1 /usr/lib/libc.so.6",
        "7f10-7f20 r-xp 00000000 08:01 2 /venv/nvidia/cuda_runtime/lib/libcudart.so.13",
        "7f20-7f30 r--p 00010000 08:01 2 /venv/nvidia/cuda_runtime/lib/libcudart.so.13",
        "7f30-7f40 r-xp 00000000 08:01 3 /venv/torch/lib/libcudart-9335f6a2.so.12 (deleted)",
        "7f40-7f50 rw-p 00000000 00:00 0 ",
        "7f50-7f60 rw-p 00000000 00:00 0 [heap]",
        "7f60-7f70 r-xp 00000000 08:01 4 /venv/torch/lib/libtorch_cuda.so",
    ])
    assert pinned_host.cudart_paths(maps) == ["/venv/nvidia/cuda_runtime/lib/libcudart.so.13",
                                              "/venv/torch/lib/libcudart-9335f6a2.so.12"]


def test_registered_map_is_page_aligned_anonymous_memory():
    memory = pinned_host._RegisteredMap(-1, 2 * PAGE)
    assert isinstance(memory, mmap.mmap) and len(memory) == 2 * PAGE
    del memory  # never registered: nothing to unregister, and no error


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE


@pytest.mark.gpu
def test_pins_exactly_on_gpu(monkeypatch):
    monkeypatch.setattr(pinned_host, "EXACT", True)
    nbytes = 300 * 2**20 + 12345
    torch.zeros(1, device="cuda")  # the CUDA context first: creating it grows the RSS by itself
    gc.collect()
    before = _rss()
    tensor = pinned_empty(nbytes)
    ours = _rss() - before
    assert tensor.shape == (nbytes,) and tensor.is_pinned()
    pattern = _fill(tensor)
    on_gpu = tensor.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(on_gpu.cpu(), pattern)
    assert ours < 1.1 * nbytes, f"pinning {nbytes} bytes grew the RSS by {ours}"
    perms, flags = _mapping_flags(tensor)  # registered for real: still private, advised, kept from children
    assert perms.endswith("p") and "hg" in flags and "dc" in flags
    del tensor, on_gpu, pattern

    empty_cache = getattr(torch._C, "_host_emptyCache", None)
    if empty_cache is not None:
        empty_cache()  # a block cached by an earlier test would not grow the RSS
    gc.collect()
    before = _rss()
    theirs_tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    theirs = _rss() - before
    assert theirs_tensor.is_pinned()
    assert ours < theirs, f"exact pinning grew the RSS by {ours}, torch's allocator by {theirs}"


@pytest.mark.gpu
def test_failed_registration_leaves_no_cuda_error_on_gpu(monkeypatch):
    """A registration CUDA refuses (invalid flags) falls back to torch's pinned memory, and the
    error it latched does not surface in the next kernel launch."""
    monkeypatch.setattr(pinned_host, "EXACT", True)
    monkeypatch.setattr(pinned_host, "_register_warned", False)
    monkeypatch.setattr(pinned_host, "REGISTER_FLAGS", 1 << 30)
    tensor = pinned_empty(PAGE + 1)
    assert tensor.shape == (PAGE + 1,) and tensor.is_pinned()
    x = torch.ones(1024, device="cuda")
    x.add_(1)
    torch.cuda.synchronize()
    assert x.sum().item() == 2048
