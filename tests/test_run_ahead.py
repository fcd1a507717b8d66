"""Split FFNs' CPU parts on a worker while the GPU waits for them in a kernel
(runtime/run_ahead.py): the wait kernel (Triton's interpreter on the CPU), the worker's protocol with
the GPU's words stood in for (no Triton or GPU needed), and on the GPU the run-ahead steps against
the CPU reference and a CPU part that fails."""

import importlib
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from vramshard.layers import cpu_compiled
from vramshard.runtime import run_ahead

from kernel_helpers import needs_kernel
from switch_helpers import assert_opt_out

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
    _in_interpreter("test_the_wait_kernel_waits_for_its_ticket_and_gives_up_at_its_limit")


def _in_interpreter(test: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "VRAMSHARD_RUN_AHEAD_WAIT": "kernel"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{__file__}::{test}"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


class _GPUWords:
    """The GPU's side of the words without Triton or a GPU: the ready word written at once when queued (as a
    kernel would write it once the copy before it is done), the ticket's wait queued and gone (the host thread
    goes on, as on a GPU)."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return self.fn


def _stand_in_for_the_gpu(monkeypatch) -> None:
    monkeypatch.setattr(run_ahead, "WAIT", "kernel")
    monkeypatch.setattr(run_ahead, "_write_word", _GPUWords(lambda word, value: word.__setitem__(0, value)),
                        raising=False)
    monkeypatch.setattr(run_ahead, "_wait_for_ticket", _GPUWords(lambda *args: None), raising=False)


def test_the_worker_runs_each_part_after_its_input_landed_and_the_host_thread_frees_the_jobs(monkeypatch):
    """The protocol of a step, the GPU's words stood in for (_GPUWords): parts run in order, none
    before the GPU wrote its ready word, each raises its ticket; a part that raises fails the drain
    and the ticket is raised anyway. Every job (its pinned input, on a GPU) is released on the host
    thread: freeing one on the worker hung a step on the GPU machine, the worker in a CUDA call while
    the host thread waited for the GPU."""
    import gc

    _stand_in_for_the_gpu(monkeypatch)
    ahead = run_ahead.RunAhead()
    ahead.team = 1  # the plan's team for these parts (TieredPlacement.worker_threads)
    ran, freed_on = [], []

    class Job:
        def __init__(self, number, fail=False):
            self.number, self.fail = number, fail

        def __call__(self):
            assert ahead._ready_view[0] >= self.number, "ran before its input landed"
            # Compiled CPU kernels run on the worker only where they leave the GIL.
            assert cpu_compiled.allowed() == cpu_compiled.kernels_release_gil(), "a GIL-holding kernel on the worker"
            time.sleep(0.02)  # the host thread has dropped its reference by now
            ran.append((self.number, time.perf_counter()))
            if self.fail:
                raise ValueError("a CPU part that fails")

        def __del__(self):
            freed_on.append(threading.current_thread().name)

    for _ in range(3):
        number = ahead.copied()
        ahead.submit(number, Job(number))
    late = ahead.copied()
    ahead.ready[0] = late - 1  # as if the GPU had not yet written it
    written = []
    threading.Timer(0.2, lambda: (written.append(time.perf_counter()), ahead.ready.__setitem__(0, late))).start()
    ahead.submit(late, Job(late))
    assert ahead.drain()[0] > 0 and ahead.ticket.item() == late
    assert [n for n, _ in ran] == [1, 2, 3, 4] and ran[-1][1] >= written[0]
    parts = ahead.last_parts  # the step's parts: no expert pass among them
    assert parts["parts"] == 4 and parts["longest_s"] >= 0.02 and parts["expert_kernel_s"] == 0.0
    assert parts["team"] == run_ahead.worker_threads(torch.get_num_threads(), 1)
    assert parts["idle_s"] < 0.1 and parts["host_buffer_wait_s"] == 0.0  # every part queued ahead of the worker
    first = ahead.copied()  # a host thread behind the worker: it waits for the second part
    ahead.submit(first, Job(first))
    time.sleep(0.15)
    second = ahead.copied()
    ahead.submit(second, Job(second))
    ahead.drain()
    assert ahead.last_parts["parts"] == 2 and 0.1 < ahead.last_parts["idle_s"] < 0.15
    gc.collect()
    assert freed_on == ["MainThread"] * 6

    with pytest.raises(RuntimeError, match="submitted out of order"):
        ahead.submit(7, Job(7))
    number = ahead.copied()
    ahead.submit(number, Job(number, fail=True))
    with pytest.raises(RuntimeError, match="a CPU part that fails"):
        ahead.drain()
    assert ahead.ticket.item() == number  # the GPU went on
    monkeypatch.setattr(run_ahead, "READY_TIMEOUT_S", 0.3)  # a ready word that never comes fails its part, and the GPU goes on
    number = ahead.copied()
    ahead.ready[0] = number - 1
    ahead.submit(number, Job(number))
    with pytest.raises(RuntimeError, match="has not told the worker"):
        ahead.drain()
    assert ahead.ticket.item() == number
    ahead.copied()  # a step that failed between the copy and the submit
    number = ahead.copied()
    ahead.submit(number, Job(number))  # the next step runs
    ahead.drain()
    assert ahead.ticket.item() == number
    ahead.close()
    gc.collect()
    # (the failed job may live on in the log capture's record of its traceback)
    assert len(freed_on) >= 8 and set(freed_on) == {"MainThread"}


def test_run_ahead_is_on_unless_turned_off(monkeypatch):
    """On unless VRAMSHARD_RUN_AHEAD turns it off (read when the module is imported)."""
    assert_opt_out(monkeypatch, run_ahead, "VRAMSHARD_RUN_AHEAD")


@pytest.mark.parametrize("value, experts, bound, dense", [
    (None, True, False, False), ("auto", True, False, False), ("bound", True, True, False), ("on", True, True, True),
    ("off", False, False, False), ("sometimes", True, False, False)])
def test_run_ahead_gives_the_worker_host_experts_by_default_and_dense_parts_when_asked(monkeypatch, value, experts,
                                                                                       bound, dense):
    """auto (the default): MoE layers' host experts only; bound: split dense FFNs' CPU parts too where they run as
    one bound C call (a few bf16/fp16 rows through the C kernel); on: every split part."""
    from vramshard.layers import cpu_gemv

    if value is None:
        monkeypatch.delenv("VRAMSHARD_RUN_AHEAD", raising=False)
    else:
        monkeypatch.setenv("VRAMSHARD_RUN_AHEAD", value)
    try:
        module = importlib.reload(run_ahead)
        assert (module.ENABLED, module.BOUND, module.DENSE) == (experts, bound, dense)
        monkeypatch.setattr(module.torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(module, "WAIT", "stream")
        assert (module.available(), module.available(dense=True)) == (experts, bound)
        monkeypatch.setattr(cpu_gemv, "computes", lambda rows: 1 <= rows <= 4)  # (as where the kernel builds)
        assert module.takes_dense(1, torch.bfloat16) is bound and module.takes_dense(4, torch.float16) is bound
        assert module.takes_dense(5, torch.bfloat16) is dense and module.takes_dense(1, torch.float32) is dense
    finally:
        monkeypatch.undo()
        importlib.reload(run_ahead)


def test_a_worker_has_the_gil_handed_over_within_its_switch_interval():
    """The interpreter's 5 ms switch interval is lowered to SWITCH_INTERVAL_S, and never raised."""
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(5e-3)
        run_ahead.hand_the_gil_over_quickly()
        assert sys.getswitchinterval() == pytest.approx(run_ahead.SWITCH_INTERVAL_S)
        sys.setswitchinterval(run_ahead.SWITCH_INTERVAL_S / 2)
        run_ahead.hand_the_gil_over_quickly()
        assert sys.getswitchinterval() == pytest.approx(run_ahead.SWITCH_INTERVAL_S / 2)
    finally:
        sys.setswitchinterval(before)


def test_the_worker_leaves_the_host_thread_a_core(monkeypatch):
    """The worker's OpenMP team takes one core fewer than the process may use, and never more
    threads than the part asked for."""
    monkeypatch.setattr(run_ahead.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert [run_ahead.worker_threads(t) for t in (16, 15, 8, 1)] == [15, 15, 8, 1]
    monkeypatch.setattr(run_ahead.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert run_ahead.worker_threads(4) == 1


@needs_kernel
@pytest.mark.parametrize("one_call", [True, False])
def test_host_experts_on_the_worker_as_one_bound_call_or_a_python_job(one_call, monkeypatch):
    """A MoE layer's host experts as the executor hands them to the worker (RunAhead.result_on with the
    layer's experts_part): with VRAMSHARD_RUN_AHEAD_ONE_CALL on, the bound C call runs instead of the Python
    job and writes what run_experts computes; the worker waits for a ready word that comes late, counts the
    call as the part's expert kernel, and raises the ticket; an expert outside the layer fails the drain with
    the ticket raised. Off: the Python job, the same sums."""
    from vramshard.layers.moe import DictExperts, MoEFFN, Routing

    monkeypatch.setattr(run_ahead, "ONE_CALL", one_call)
    _stand_in_for_the_gpu(monkeypatch)
    g = torch.Generator().manual_seed(3)
    E, width, hidden, k = 8, 16, 48, 2
    stacked = torch.randn(E, 3 * width * hidden, generator=g).to(torch.bfloat16)
    weights = {}
    for e in range(E):
        weights[f"experts.{e}.gate_up"] = stacked[e, : 2 * width * hidden].view(2 * width, hidden)
        weights[f"experts.{e}.down"] = stacked[e, 2 * width * hidden :].view(hidden, width)
    source = DictExperts(weights, E, stack=True)
    layer = MoEFFN.__new__(MoEFFN)  # (run_experts and experts_part read nothing of the layer's config)
    h = torch.randn(1, hidden, generator=g).to(torch.bfloat16)
    routing = Routing(torch.tensor([[5, 2]]), torch.rand(1, k, generator=g).to(torch.bfloat16))
    expected = layer.run_experts(source, h, routing)
    filled = []

    def fill(out):
        filled.append(True)
        out.copy_(layer.run_experts(source, h, routing))

    ahead = run_ahead.RunAhead()
    ahead.team = 1
    for spin_s in (run_ahead.SPIN_S, 2.0):  # the word comes after the spin (then the polls), or within it
        monkeypatch.setattr(run_ahead, "SPIN_S", spin_s)
        filled.clear()
        number = ahead.copied()
        ahead.ready[0] = number - 1  # the GPU writes it 0.1 s from now
        threading.Timer(0.1, lambda: ahead.ready.__setitem__(0, number)).start()
        y = ahead.result_on(torch.device("cpu"), number, h, fill,
                            lambda out: layer.experts_part(source, h, routing, out))
        computing, waiting = ahead.drain()
        assert ahead.ticket.item() == number and filled == ([] if one_call else [True])
        torch.testing.assert_close(y, expected, rtol=0, atol=0)
        assert waiting >= 0.08 and 0 < computing < 0.08 and ahead.last_parts["expert_kernel_s"] > 0
    if one_call:
        routing.experts[0, 1] = E  # outside the layer: the kernel refuses it, the GPU goes on
        number = ahead.copied()
        ahead.result_on(torch.device("cpu"), number, h, fill, lambda out: layer.experts_part(source, h, routing, out))
        with pytest.raises(RuntimeError, match="refused the routed experts"):
            ahead.drain()
        assert ahead.ticket.item() == number
    ahead.close()


@needs_kernel
@pytest.mark.parametrize("one_call", [True, False])
def test_a_split_ffns_cpu_part_on_the_worker_as_one_bound_call_or_a_python_job(one_call, monkeypatch):
    """A split dense FFN's few-row CPU part as the executor hands it to the worker (RunAhead.result_on with the
    FFN's contribution_part): with VRAMSHARD_RUN_AHEAD_ONE_CALL on, the bound C call runs instead of the Python
    job, once the ready word comes (late), and writes what contribution computes; it is not counted as an
    expert kernel. Off: the Python job, the same sums."""
    from test_split_ffn import _ffn, _whole

    monkeypatch.setattr(run_ahead, "ONE_CALL", one_call)
    _stand_in_for_the_gpu(monkeypatch)
    ffn, weights = _ffn(torch.bfloat16, hidden=64, intermediate=96)
    part = ffn.pieces_of(_whole(ffn, weights), 0, 5)
    h = torch.randn(1, ffn.hidden, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    filled = []

    def fill(out):
        filled.append(True)
        out.copy_(ffn.contribution(part, h))

    ahead = run_ahead.RunAhead()
    number = ahead.copied()
    ahead.ready[0] = number - 1  # the GPU writes it 0.1 s from now
    threading.Timer(0.1, lambda: ahead.ready.__setitem__(0, number)).start()
    y = ahead.result_on(torch.device("cpu"), number, h, fill, lambda out: ffn.contribution_part(part, h, out))
    computing, waiting = ahead.drain()
    ahead.close()
    assert ahead.ticket.item() == number and filled == ([] if one_call else [True])
    torch.testing.assert_close(y, ffn.contribution(part, h))  # (the worker's team may sum in another order)
    assert waiting >= 0.08 and 0 < computing < 0.08 and ahead.last_parts["expert_kernel_s"] == 0
