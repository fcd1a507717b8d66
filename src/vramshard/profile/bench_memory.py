"""Host memory read bandwidth: what a one-token step's CPU work moves with.

A one-token projection reads its weight once, so its time on the CPU follows the bandwidth the
host's memory gives all cores; that is what differs between boots of one machine type and on a
laptop on battery or beside a game. The profile records it (``cpu.read_gb_s``) so that an engine
can check later whether the host still reads as fast (:mod:`vramshard.profile.drift`).
"""

from __future__ import annotations

import torch

from .bench_matmul import cold_bytes, host_copy
from .timing import time_cpu


def measure_cpu_read(budget_s: float, nbytes: int | None = None) -> float:
    """Bytes per second the CPU reads from memory with all torch threads: the sum of a float32
    buffer of ``nbytes`` (default: twice the last-level cache, at least 512 MiB) in memory as the
    engine's host weights lie (on 2 MiB pages where the kernel gives them: 27.7 against 25.1 GB/s on
    4 KiB pages on the development machine, session 36), lower quartile of repeated runs. The
    benchmarks' host read (``benchmarks/common.cpu_read_bandwidth``) is this too."""
    buffer = host_copy(torch.ones((nbytes or cold_bytes("cpu")) // 4, dtype=torch.float32))  # (as weights lie)
    seconds = time_cpu(buffer.sum, budget_s, min_reps=5)
    return buffer.nbytes / seconds
