"""Host memory read bandwidth: what a one-token step's CPU work moves with.

A one-token projection reads its weight once, so its time on the CPU follows the bandwidth the
host's memory gives all cores; that is what differs between boots of one machine type and on a
laptop on battery or beside a game. The profile records it (``cpu.read_gb_s``) so that an engine
can check later whether the host still reads as fast (:mod:`vramshard.profile.drift`).

GPU attention over a KV cache kept in host memory first gathers the step's cached blocks into a
pinned buffer (:mod:`vramshard.runtime.kv_staging`); that gather reads and writes every byte, on
all torch threads, and the profile records its rate too (``cpu.gather_gb_s``).
"""

from __future__ import annotations

import torch

from ..runtime.pinned_host import pinned_empty
from .bench_matmul import cold_bytes, host_copy
from .timing import time_cpu

KV_BLOCK = (16, 8, 128)  # positions, KV heads, head_dim: one block of an 8B model's host KV cache (32 KiB in bf16)


def measure_cpu_read(budget_s: float, nbytes: int | None = None) -> float:
    """Bytes per second the CPU reads from memory with all torch threads: the sum of a float32
    buffer of ``nbytes`` (default: twice the last-level cache, at least 512 MiB) in memory as the
    engine's host weights lie (on 2 MiB pages where the kernel gives them: 27.7 against 25.1 GB/s on
    4 KiB pages on the development machine, session 36), lower quartile of repeated runs. The
    benchmarks' host read (``benchmarks/common.cpu_read_bandwidth``) is this too."""
    buffer = host_copy(torch.ones((nbytes or cold_bytes("cpu")) // 4, dtype=torch.float32))  # (as weights lie)
    seconds = time_cpu(buffer.sum, budget_s, min_reps=5)
    return buffer.nbytes / seconds


def measure_cpu_gather(budget_s: float, nbytes: int | None = None) -> float:
    """Bytes per second the CPU gathers KV-cache blocks into a pinned buffer with all torch threads, counted
    once (the bytes that arrive): ``torch.index_select`` of half the blocks of a bf16 cache of ``nbytes``
    (default: twice the last-level cache, at least 512 MiB), in a shuffled order, as the staging of a host
    KV cache gathers the step's sequences' blocks before their copy to the GPU. Lower quartile of repeated
    runs."""
    block_bytes = 2 * KV_BLOCK[0] * KV_BLOCK[1] * KV_BLOCK[2]
    blocks = max(2, (nbytes or cold_bytes("cpu")) // block_bytes)
    cache = host_copy(torch.ones((blocks, *KV_BLOCK), dtype=torch.bfloat16))
    index = torch.randperm(blocks)[: blocks // 2]
    out = pinned_empty(len(index) * block_bytes).view(torch.bfloat16).view(len(index), *KV_BLOCK)
    seconds = time_cpu(lambda: torch.index_select(cache, 0, index, out=out), budget_s, min_reps=5)
    return out.nbytes / seconds
