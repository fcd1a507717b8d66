"""Split FFNs' CPU parts on a worker while the GPU waits for them in a kernel
(runtime/run_ahead.py): the wait kernel (Triton's interpreter on the CPU), and on the GPU the
run-ahead steps against the CPU reference and a CPU part that fails."""

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from vramshard.runtime import run_ahead

needs_triton = pytest.mark.skipif(run_ahead.triton is None, reason="needs Triton")


@needs_triton
def test_the_wait_kernel_waits_for_its_ticket_and_gives_up_at_its_limit():
    """Interpreted on the CPU in a fresh process (Triton reads TRITON_INTERPRET when imported)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        ticket, gave_up = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int32)
        view = ticket.numpy()
        threading.Timer(0.2, lambda: view.__setitem__(0, 3)).start()
        start = time.perf_counter()
        run_ahead._wait_for_ticket[(1,)](ticket, 3, 10**9, gave_up)
        assert time.perf_counter() - start >= 0.19 and view[0] == 3
        run_ahead._wait_for_ticket[(1,)](ticket, 2, 10**9, gave_up)  # already past: returns at once
        assert gave_up.item() == 0
        run_ahead._wait_for_ticket[(1,)](ticket, 5, 100, gave_up)  # never raised: gives up after 100 polls
        assert gave_up.item() == 1
        return
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"{__file__}::test_the_wait_kernel_waits_for_its_ticket_and_gives_up_at_its_limit"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


def test_run_ahead_is_opt_in(monkeypatch):
    """Off unless VRAMSHARD_RUN_AHEAD asks for it (read when the module is imported)."""
    import importlib

    monkeypatch.delenv("VRAMSHARD_RUN_AHEAD", raising=False)
    try:
        assert not importlib.reload(run_ahead).ENABLED and not run_ahead.available()
        monkeypatch.setenv("VRAMSHARD_RUN_AHEAD", "on")
        assert importlib.reload(run_ahead).ENABLED
    finally:
        monkeypatch.undo()
        importlib.reload(run_ahead)
