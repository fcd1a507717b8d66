"""The Triton paged decode attention kernel against the same function in plain torch.

On a GPU (``gpu`` marker) it runs as the decode graphs run it; without one, where Triton is
installed, the same cases run through Triton's interpreter on the CPU.
"""

import math
import os
import subprocess
import sys

import pytest
import torch

from vramshard.layers import paged_decode


def reference(q, k, v, cache_k, cache_v, block_tables, positions, write_index, write_source, key_length):
    """What the kernel computes, in plain torch (float32 softmax), row by row and head by head."""
    flat_k, flat_v = cache_k.view(-1, *cache_k.shape[2:]), cache_v.view(-1, *cache_v.shape[2:])
    flat_k[write_index] = k.to(flat_k.dtype)[write_source]
    flat_v[write_index] = v.to(flat_v.dtype)[write_source]
    B, H, D = q.shape
    hkv, size = cache_k.shape[2], cache_k.shape[1]
    out = torch.empty_like(q)
    for b in range(B):
        n = int(positions[b]) + 1
        rows = torch.cat([torch.arange(blk * size, blk * size + size) for blk in block_tables[b].tolist()])[:n]
        keys, values = flat_k[rows].float(), flat_v[rows].float()  # [n, Hkv, D]
        for h in range(H):
            scores = (keys[:, h // (H // hkv)] @ q[b, h].float()) / math.sqrt(D)
            out[b, h] = (scores.softmax(0) @ values[:, h // (H // hkv)]).to(q.dtype)
    return out


needs_triton = pytest.mark.skipif(paged_decode.triton is None,
                                  reason="the paged decode kernel needs Triton (CUDA builds of torch ship it)")

CASES = [  # rows, query heads, KV heads, head dim, positions (row b attends to positions[b] + 1 keys)
    (1, 8, 2, 32, [37]),
    (3, 8, 2, 32, [0, 15, 50]),
    (2, 4, 4, 16, [16, 31]),
    (4, 32, 8, 128, [1087, 200, 63, 64]),
]


def _case(rows, heads, kv_heads, head_dim, positions, dtype, device, block_size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    nb = max(p // block_size + 1 for p in positions)
    pool = rows * nb + 3
    cache_k = torch.randn(pool, block_size, kv_heads, head_dim, generator=g).to(dtype)
    cache_v = torch.randn(pool, block_size, kv_heads, head_dim, generator=g).to(dtype)
    order = torch.randperm(pool, generator=g)
    tables = torch.stack([order[b * nb:(b + 1) * nb] for b in range(rows)])  # scattered, out of order
    pos = torch.tensor(positions)
    write = torch.tensor([int(tables[b, p // block_size]) * block_size + p % block_size for b, p in enumerate(positions)])
    q = torch.randn(rows, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(rows, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(rows, kv_heads, head_dim, generator=g).to(dtype)
    tensors = [q, k, v, cache_k, cache_v, tables, pos, write, torch.arange(rows)]
    return [t.to(device) for t in tensors], nb * block_size


def _check(device, dtype):
    for rows, heads, kv_heads, head_dim, positions in CASES:
        (q, k, v, ck, cv, tables, pos, write, source), keys = _case(rows, heads, kv_heads, head_dim, positions,
                                                                    dtype, device)
        if rows > 2:  # as the decode graphs pass them: columns of one packed index tensor
            packed = torch.cat([torch.stack([pos, write, source], 1), tables], 1)
            pos, write, source, tables = packed[:, 0], packed[:, 1], packed[:, 2], packed[:, 3:]
        ref_k, ref_v = ck.clone(), cv.clone()
        expected = reference(q, k, v, ref_k, ref_v, tables, pos, write, source, keys)
        got = paged_decode.paged_decode_attention(q, k, v, ck, cv, tables, pos, write, source, keys)
        torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)
        assert torch.equal(ck, ref_k) and torch.equal(cv, ref_v)  # the new keys and values stored, nothing else


def _check_padded_rows(device, dtype):
    """Rows past a step's sequences repeat row 0's write and table (static_attention): rows 0-1 stay right."""
    (q, k, v, ck, cv, tables, pos, write, source), keys = _case(2, 8, 2, 32, [40, 60], dtype, device)
    pad = lambda t, first: torch.cat([t, first.expand(2, *t.shape[1:])])  # noqa: E731
    q4, k4, v4 = (torch.cat([t, torch.randn_like(t)]) for t in (q, k, v))
    tables4, write4 = pad(tables, tables[:1]), pad(write, write[:1])
    pos4 = torch.cat([pos, torch.zeros_like(pos)])
    source4 = torch.tensor([0, 1, 0, 0], device=device)
    ref_k, ref_v = ck.clone(), cv.clone()
    expected = reference(q, k, v, ref_k, ref_v, tables, pos, write, source, keys)
    got = paged_decode.paged_decode_attention(q4, k4, v4, ck, cv, tables4, pos4, write4, source4, keys)
    torch.testing.assert_close(got[:2].float(), expected.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(ck, ref_k) and torch.equal(cv, ref_v)


def test_split_sizes_fill_the_gpu():
    cpu = torch.device("cpu")  # 8 "multiprocessors" off a GPU
    assert paged_decode.split_blocks(1, 8, 68, cpu) == 34  # 2 splits: 16 programs
    assert paged_decode.split_blocks(64, 8, 68, cpu) == 68  # rows x heads fill it already: one split
    assert paged_decode.split_blocks(1, 1, 3, cpu) == 1  # never a split without a block


@needs_triton
def test_interpreted_on_the_cpu():
    """Triton's interpreter reads TRITON_INTERPRET when Triton is imported: a fresh process runs the
    cases on the CPU with it set (this test, again, in that process)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        _check("cpu", torch.float16)
        _check_padded_rows("cpu", torch.float16)
        return
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"{__file__}::test_interpreted_on_the_cpu"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_kernel_matches_torch(dtype):
    assert paged_decode.available(torch.empty(1, 8, 128, dtype=dtype, device="cuda"), 16)
    _check("cuda", dtype)
    _check_padded_rows("cuda", dtype)
