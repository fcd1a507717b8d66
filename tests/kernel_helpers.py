"""The C kernel's tests: skipped where it does not build, except on CI, whose machine has a C compiler
(inductor needs one too): there the kernel must build, and its tests run (and fail if it does not)."""

import os

import pytest

from vramshard.layers import cpu_gemv

ON_CI = bool(os.environ.get("CI"))
needs_kernel = pytest.mark.skipif(cpu_gemv.library() is None and not ON_CI,
                                  reason=f"the C kernel does not build here ({cpu_gemv.failure()})")
