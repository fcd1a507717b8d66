"""CUDA streams the runtime keeps for the life of the process, one per (device, role).

cuBLAS keeps a workspace (32 MiB on Hopper) in the caching allocator for every stream it has run
a matmul on, until the process ends. A new stream per executor therefore left 32 MiB reserved
behind each executor: in one ``moe_bench`` run on the H200 machine (fourteenth GPU session) the
memory reserved before each new executor grew by 32 MiB an executor, to 0.5 GiB, and a cell
whose plan filled its budget went 18 MiB over it. Executors (and their decode graphs) made one
after another in a process, re-plans and reloads, take their streams from here instead. Two
executors alive at once share them: their work is then ordered, not wrong.
"""

from __future__ import annotations

import threading

import torch

_streams: dict[tuple[int, str], torch.cuda.Stream] = {}
_lock = threading.Lock()


def process_stream(device: torch.device, role: str) -> torch.cuda.Stream:
    """The stream for ``role`` ("compute", "copy", "graphs", ...) on ``device``, made once."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        stream = _streams.get((index, role))
        if stream is None:
            stream = _streams[index, role] = torch.cuda.Stream(torch.device("cuda", index))
        return stream
