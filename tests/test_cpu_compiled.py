"""The settings the CPU kernels compile under: trusted instruction-set flags, withdrawn on failure."""

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
