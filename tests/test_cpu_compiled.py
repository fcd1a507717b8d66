"""The settings the CPU kernels compile under: trusted instruction-set flags, withdrawn on failure."""

import random

import pytest
import torch

from vramshard.layers import cpu_compiled
from vramshard.layers.cpu_compiled import CompiledKernel


def test_a_kernel_compiles_under_trusted_flags_and_in_process(monkeypatch):
    from torch._inductor import config

    monkeypatch.setattr(cpu_compiled, "_trust_isa_flags", True)
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    monkeypatch.setattr(config.cpp, "vec_isa_ok", None)
    seen = []

    def sums(x):
        seen.append((config.cpp.vec_isa_ok, config.compile_threads))  # (read while torch traces it)
        return (x.float() * 2).sum(-1)

    kernel = CompiledKernel(sums, "test sums", "run eagerly")
    assert torch.equal(kernel(torch.ones(3, 4, dtype=torch.bfloat16)), torch.full((3,), 8.0))
    assert seen[0] == (True, 1) and kernel.failed is None
    assert config.cpp.vec_isa_ok is None  # only while compiling


def test_what_the_user_set_stays(monkeypatch):
    from torch._inductor import config

    monkeypatch.setattr(config.cpp, "vec_isa_ok", False)
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "3")
    monkeypatch.setattr(config, "compile_threads", 3)
    settings, trusted = cpu_compiled.compile_settings()
    with settings:
        assert config.cpp.vec_isa_ok is False and config.compile_threads == 3
    assert not trusted


def test_a_compile_that_fails_under_trusted_flags_is_tried_again_with_probes(monkeypatch, caplog):
    from torch._inductor import config

    monkeypatch.setattr(cpu_compiled, "_trust_isa_flags", True)
    monkeypatch.setattr(config.cpp, "vec_isa_ok", None)
    attempts, compiles = [], []

    def fake_compile(fn, dynamic):  # stands in for torch.compile: fails while the flags are trusted
        compiles.append(fn)

        def call(*args):
            attempts.append(config.cpp.vec_isa_ok)
            if config.cpp.vec_isa_ok:
                raise RuntimeError("g++: error: unrecognized command-line option '-mamx-tile'")
            return fn(*args)
        return call

    monkeypatch.setattr(torch, "compile", fake_compile)
    kernel = CompiledKernel(lambda x: x * 2, "test doubles", "run eagerly")
    with caplog.at_level("INFO", logger="vramshard.layers.cpu_compiled"):
        assert torch.equal(kernel(torch.ones(2)), torch.full((2,), 2.0))
    assert attempts == [True, None] and kernel.failed is None and not cpu_compiled._trust_isa_flags
    assert "probing the instruction sets instead" in caplog.text
    assert torch.equal(kernel(torch.ones(2)), torch.full((2,), 2.0)) and len(compiles) == 2  # not again
    monkeypatch.setattr(config.cpp, "vec_isa_ok", None)
    other = CompiledKernel(lambda x: x + 1, "test increments", "run eagerly")
    assert torch.equal(other(torch.ones(2)), torch.full((2,), 2.0)) and attempts[-1] is None  # no trust any more


def _heavy(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x[:, None, :] * w[None]).sum(-1)  # [M, N]: one reduction loop nest


def test_a_compiled_kernel_leaves_the_gil_to_other_threads_while_it_runs():
    """Inductor's binding held the GIL through the kernel: a Python thread beside a compiled kernel
    ran at 0.03 of its pace alone on the development machine. With the binding changed it runs on."""
    import threading
    import time

    assert cpu_compiled.kernels_release_gil()  # this torch's binding is the one vramshard knows
    kernel = CompiledKernel(_heavy, "a test kernel", "fail the test")
    x, w = torch.randn(16, 2048), torch.randn(2048, 2048)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the kernel on one core, the Python thread on another
    try:
        out = kernel(x, w)
        assert out is not None and torch.allclose(out, x @ w.t(), rtol=1e-3, atol=1e-2)
        count, stop = [0], threading.Event()

        def spin():
            while not stop.is_set():
                count[0] += 1

        spinner = threading.Thread(target=spin)
        spinner.start()
        time.sleep(0.05)
        before, t0 = count[0], time.perf_counter()
        time.sleep(0.2)
        alone = (count[0] - before) / (time.perf_counter() - t0)
        before, t0 = count[0], time.perf_counter()
        for _ in range(5):
            kernel(x, w)
        beside = (count[0] - before) / (time.perf_counter() - t0)
        stop.set()
        spinner.join()
    finally:
        torch.set_num_threads(threads)
    assert beside > 0.3 * alone
    with cpu_compiled.gil_kept_free():
        assert cpu_compiled.allowed()  # a thread that must leave the GIL may run them now


def test_a_compile_that_fails_with_the_releasing_binding_is_tried_again_with_inductors_own(monkeypatch, caplog):
    """Another compiler may refuse the binding that leaves the GIL: the kernel then compiles with
    inductor's own binding, and kernels keep the GIL from then on (a worker no longer runs them)."""
    from torch._inductor import codecache

    assert cpu_compiled.kernels_release_gil()
    binding = codecache.CppPythonBindingsCodeCache
    monkeypatch.setattr(cpu_compiled, "_trust_isa_flags", False)  # (that retry is tested above)
    monkeypatch.setattr(binding, "call_entry_function", binding.call_entry_function)  # restored after
    monkeypatch.setattr(binding, "suffix_template", binding.suffix_template)
    monkeypatch.setattr(cpu_compiled, "_RELEASES_GIL", [True])
    real_compile, tries = torch.compile, []

    def compile_failing_while_releasing(fn, **kwargs):
        compiled = real_compile(fn, **kwargs)

        def call(*args):
            tries.append(binding.call_entry_function == cpu_compiled._RELEASING)
            if tries[-1]:
                raise RuntimeError("the C++ compiler refused the binding")
            return compiled(*args)
        return call

    monkeypatch.setattr(torch, "compile", compile_failing_while_releasing)
    kernel = CompiledKernel(lambda x: (x.float() * 3).sum(-1), "test sums", "run eagerly")
    with caplog.at_level("WARNING", logger="vramshard.layers.cpu_compiled"):
        out = kernel(torch.ones(2, 5))
    assert tries == [True, False] and torch.equal(out, torch.full((2,), 15.0))
    assert "keep the GIL" in caplog.text and not cpu_compiled.kernels_release_gil()
    assert binding.call_entry_function == cpu_compiled._HOLDING and "#include <tuple>" not in binding.suffix_template
    with cpu_compiled.gil_kept_free():
        assert not cpu_compiled.allowed()
    # A function that fails with either binding does not take the releasing one away.
    assert cpu_compiled.kernels_release_gil(again=True) and binding.call_entry_function == cpu_compiled._RELEASING

    def broken(x):
        raise ValueError("not the binding's fault")

    tries.clear()
    assert CompiledKernel(broken, "test failures", "run eagerly")(torch.ones(2)) is None
    assert tries == [True, False] and cpu_compiled.kernels_release_gil()
    assert binding.call_entry_function == cpu_compiled._RELEASING


def test_compiled_kernels_read_the_callers_thread_count_when_they_run(monkeypatch):
    """Inductor wrote the compilation's thread count into the kernel, and torch's cache of compiled
    graphs did not key on it before pytorch/pytorch#160812's fix: a kernel compiled on one thread was
    served to a compilation for all cores. The kernels now read the calling thread's count as they run."""
    from torch._inductor import config
    from torch._inductor.graph import GraphLowering

    if not hasattr(GraphLowering, "save_output_code"):
        pytest.skip("this torch's inductor hands its generated code to no hook")
    sources = []  # (as torch's run_and_get_code, without its dynamo reset: that drops every kernel compiled so far)
    monkeypatch.setattr(GraphLowering, "save_output_code", staticmethod(sources.append))
    monkeypatch.delenv("TORCHINDUCTOR_CPP_DYNAMIC_THREADS", raising=False)
    monkeypatch.setattr(config.cpp, "dynamic_threads", False)
    scale = 1.0 + random.random()  # a graph no earlier run compiled: inductor generates its code (no cache hit)

    def row_sums(x, w):
        return (w.float() * x.float()).sum(-1) * scale  # [N]: one row of w per output, x broadcast

    kernel = CompiledKernel(row_sums, "a test kernel", "fail the test")
    x, w = torch.randn(1, 512), torch.randn(1024, 512)
    out = kernel(x, w)
    assert torch.allclose(out, (w @ x[0]) * scale, rtol=1e-4, atol=1e-3)
    code = "\n".join(sources)
    assert config.cpp.dynamic_threads
    assert "#pragma omp parallel" in code
    assert "num_threads(" not in code, "the compilation's thread count is written into the kernel"


def test_the_users_own_thread_settings_stay(monkeypatch):
    from torch._inductor import config

    monkeypatch.setattr(config.cpp, "dynamic_threads", False)
    monkeypatch.setenv("TORCHINDUCTOR_CPP_DYNAMIC_THREADS", "0")
    assert not cpu_compiled.kernels_read_threads_at_run_time() and not config.cpp.dynamic_threads
    monkeypatch.delenv("TORCHINDUCTOR_CPP_DYNAMIC_THREADS")
    monkeypatch.setattr(config.cpp, "threads", 3)
    assert not cpu_compiled.kernels_read_threads_at_run_time() and not config.cpp.dynamic_threads


def test_compiled_kernels_are_kept_in_vramshards_cache_unless_a_directory_is_set(monkeypatch, tmp_path):
    """Inductor's default cache is under /tmp (emptied at boot on many systems): the kernels go under
    vramshard's cache directory instead; a directory the user (or inductor) set stays."""
    monkeypatch.setenv("VRAMSHARD_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert cpu_compiled.keep_compiled_in_user_cache() == str(tmp_path / "cache" / "inductor")
    cache_dir_utils = pytest.importorskip("torch._inductor.runtime.cache_dir_utils")
    assert cache_dir_utils.cache_dir() == str(tmp_path / "cache" / "inductor")  # inductor's own lookup agrees
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert cpu_compiled.keep_compiled_in_user_cache() == str(tmp_path / "mine")
