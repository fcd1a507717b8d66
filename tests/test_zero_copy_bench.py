"""benchmarks/zero_copy.py's GEMV kernel (Triton's interpreter on the CPU): the product it times is
the right one, for each block shape and a row count that is not a multiple of the block."""

import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")


def test_the_zero_copy_gemv_computes_the_matrix_vector_product():
    if os.environ.get("TRITON_INTERPRET") != "1":
        env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{__file__}"],
                              env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
        return
    from benchmarks.zero_copy import gemv

    torch.manual_seed(0)
    weight = torch.randn(37, 1000, dtype=torch.bfloat16)
    x = torch.randn(1000, dtype=torch.bfloat16)
    expected = torch.mv(weight.float(), x.float())
    for block_r, block_k in ((8, 512), (16, 256), (4, 1024)):
        got = gemv(weight, x, torch.empty(37, dtype=torch.bfloat16), block_r, block_k).float()
        torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())
