"""The C kernel (layers/cpu_gemv.c) stays inside its buffers: every build of it (AVX-512, AVX2 + F16C, plain C),
compiled with AddressSanitizer and UndefinedBehaviorSanitizer beside tests/c/cpu_gemv_harness.c, runs every
entry over random shapes, strides, routings (ties, keep masks) and thread counts, each buffer exactly as long
as the call may read, and gets the double-precision sums."""

import os
import platform
import subprocess
from pathlib import Path

import pytest

from vramshard.layers import cpu_gemv

HARNESS = Path(__file__).parent / "c" / "cpu_gemv_harness.c"
NARROWER = {"native": (), "avx2": ("-mno-avx512f",), "plain": ("-mno-avx512f", "-mno-avx2", "-mno-f16c", "-mno-fma")}
SANITIZE = ("-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer")
ON_CI = bool(os.environ.get("CI"))
X86 = platform.machine() in ("x86_64", "AMD64")


def _compiler() -> str:
    compiler = cpu_gemv._compiler()
    if compiler is None:
        if ON_CI:
            pytest.fail("no C compiler on CI, where the kernel must build")
        pytest.skip("no C compiler here")
    return compiler


@pytest.mark.parametrize("isa", ["native", "avx2", "plain"])
def test_every_build_stays_in_its_buffers_and_sums_right(isa, tmp_path):
    compiler = _compiler()
    if isa != "native" and not X86:
        pytest.skip("the narrower builds are x86's")
    exe = tmp_path / f"harness-{isa}"
    built = subprocess.run([compiler, "-O1", "-g", "-march=native", *NARROWER[isa], "-fopenmp", *SANITIZE,
                            str(HARNESS), str(cpu_gemv.SOURCE), "-lm", "-o", str(exe)],
                           capture_output=True, text=True, timeout=180)
    if built.returncode != 0:
        if "sanitize" in built.stderr and not ON_CI:
            pytest.skip(f"{Path(compiler).name} cannot build with the sanitizers here: {built.stderr[-300:]}")
        pytest.fail(f"the sanitized build failed: {built.stderr[-800:]}")
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=0:abort_on_error=0", UBSAN_OPTIONS="print_stacktrace=1")
    ran = subprocess.run([str(exe), "40"], capture_output=True, text=True, timeout=300, env=env)
    assert ran.returncode == 0, f"{isa} build: {ran.stderr[-2000:]}"
    assert "all calls in bounds and right" in ran.stdout
