"""A CPU SwiGLU of a few rows as one compiled function: it computes the FFN's function in every
layout the executor passes, compiles once for all of them, and is chosen per shape by timing its
real calls."""

import time

import pytest
import torch
import torch.nn.functional as F

from vramshard.layers import cpu_compiled, cpu_linear, cpu_swiglu, mlp
from vramshard.profile.bench_split import split_ffn
from vramshard.runtime.host_weights import pack_sublayer


@pytest.fixture(autouse=True)
def _torch_paths(monkeypatch):
    """These paths serve one row where the C kernel does not (layers/cpu_gemv.py; VRAMSHARD_CPU_GEMV=off,
    or no compiler): it is switched off here so they run."""
    monkeypatch.setenv("VRAMSHARD_CPU_GEMV", "off")


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch):
    monkeypatch.setattr(cpu_linear, "COMPILED", False)  # (the projections' own compiled path: test_cpu_linear)
    cpu_linear.forget()
    cpu_swiglu.forget()
    yield
    cpu_linear.forget()
    cpu_swiglu.forget()


def _ffn_weights(dtype: torch.dtype, hidden: int = 64, intermediate: int = 96, seed: int = 0):
    """A dense FFN's weights packed as the executor holds them: whole, and split (down stored transposed)."""
    ffn = split_ffn(hidden, intermediate, dtype)
    g = torch.Generator().manual_seed(seed)
    weights = {spec.source: (torch.randn(spec.shape, generator=g) * 0.1).to(dtype) if len(spec.shape) > 1
               else torch.ones(spec.shape, dtype=dtype) for spec in ffn.weights}
    whole = pack_sublayer(ffn, weights, pin=False, splittable=False).views
    split = pack_sublayer(ffn, weights, pin=False, splittable=True).views
    return ffn, whole, split


def _reference(h: torch.Tensor, w: dict) -> torch.Tensor:
    gate, up = (w["gate_proj"], w["up_proj"]) if "gate_proj" in w else w["gate_up_proj"].chunk(2, dim=0)
    x = h.float()
    return F.linear(F.silu(F.linear(x, gate.float())) * F.linear(x, up.float()), w["down_proj"].float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_the_compiled_call_computes_the_ffn_in_each_layout_the_executor_passes(dtype, rows):
    ffn, whole, split = _ffn_weights(dtype, seed=rows)
    h = torch.randn(rows, 64, generator=torch.Generator().manual_seed(7)).to(dtype)
    with torch.inference_mode():
        for w in (whole, ffn.pieces_of(split, 0, 5), ffn.pieces_of(split, 3, 16)):
            gate, up = (w["gate_proj"], w["up_proj"]) if "gate_proj" in w else w["gate_up_proj"].chunk(2, dim=0)
            y = cpu_swiglu.compiled(h, gate, up, w["down_proj"])
            assert y is not None and y.shape == (rows, 64) and y.dtype == dtype
            torch.testing.assert_close(y.float(), _reference(h, w), atol=0.02, rtol=0.02)
    assert cpu_swiglu.MAX_ROWS >= 64


def test_an_ffn_on_the_cpu_computes_the_same_whichever_way_is_chosen(monkeypatch):
    """The trials alternate the two ways on real calls; both give the FFN's output, into the
    executor's buffers too."""
    ffn, whole, split = _ffn_weights(torch.bfloat16)
    part = ffn.pieces_of(split, 0, 6)
    with torch.inference_mode():
        for rows in (1, 4):
            h = torch.randn(rows, 64).bfloat16()
            for _ in range(4 * cpu_swiglu.TRIALS + 2):  # (the projections' own trials come first)
                torch.testing.assert_close(ffn.contribution(whole, h).float(), _reference(h, whole), atol=0.02, rtol=0.02)
                out, work = torch.empty(rows, 64).bfloat16(), torch.empty(ffn.work_elements(part, rows)).bfloat16()
                y = ffn.contribution_into(part, h, out, work)
                assert y is out
                torch.testing.assert_close(out.float(), _reference(h, part), atol=0.02, rtol=0.02)
    ways = cpu_swiglu.chosen()
    assert len(ways) == 4 and set(ways.values()) <= {"projections", "compiled"}  # 2 row counts x 2 layouts


_REAL_COMPILED = cpu_swiglu.compiled


def _time_ways(monkeypatch, compiled_s: float, projections_s: float) -> dict:
    """Run a one-token part until chosen, with each way slowed to the given seconds."""
    compiled_calls = [0]

    def slow_compiled(*args):
        compiled_calls[0] += 1
        time.sleep(compiled_s)
        return _REAL_COMPILED(*args)

    monkeypatch.setattr(cpu_swiglu, "compiled", slow_compiled)
    ffn, whole, _ = _ffn_weights(torch.bfloat16)
    gate, up, down = whole["gate_proj"], whole["up_proj"], whole["down_proj"]
    h = torch.randn(1, 64).bfloat16()
    calls = {"projections": 0}

    def projections():
        calls["projections"] += 1
        time.sleep(projections_s)
        return mlp._swiglu(h, gate, up, down)

    with torch.inference_mode():
        cpu_linear.settle(lambda: cpu_swiglu.swiglu(h, gate, up, down, projections))
        before = calls["projections"]
        for _ in range(3):
            cpu_swiglu.swiglu(h, gate, up, down, projections)
    return {"choice": cpu_swiglu.chosen(), "projections_after": calls["projections"] - before,
            "compiled_calls": compiled_calls[0]}


def test_the_choice_follows_the_timings(monkeypatch):
    slow = _time_ways(monkeypatch, compiled_s=0.03, projections_s=0.0)
    assert list(slow["choice"].values()) == ["projections"] and slow["projections_after"] == 3
    cpu_swiglu.forget()
    cpu_linear.forget()
    fast = _time_ways(monkeypatch, compiled_s=0.0, projections_s=0.03)
    assert list(fast["choice"].values()) == ["compiled"] and fast["projections_after"] == 0
    # the trial: its first compiled call (the compilation) untimed, then TRIALS timed; none but these
    assert slow["compiled_calls"] == cpu_swiglu.TRIALS + 1 and fast["compiled_calls"] == cpu_swiglu.TRIALS + 1 + 3


def test_the_projections_time_counts_only_once_their_own_paths_are_chosen():
    """Until the three projections have chosen their paths (their trials time slow candidates too),
    the part's trial does not count the projections' calls: the compiled call takes its trials first."""
    ffn, whole, _ = _ffn_weights(torch.bfloat16)
    h = torch.randn(1, 64).bfloat16()
    with torch.inference_mode():
        for _ in range(cpu_swiglu.TRIALS + 2):
            ffn.contribution(whole, h)
    assert cpu_linear._trials  # the projections are still on trial (linear and mv in turn)
    (times,) = cpu_swiglu._trials.values()
    assert times["projections"] == [] and len(times["compiled"]) == cpu_swiglu.TRIALS and times["untimed"]
    with torch.inference_mode():
        cpu_linear.settle(lambda: ffn.contribution(whole, h))
    assert not cpu_linear._trials and not cpu_swiglu._trials and len(cpu_swiglu.chosen()) == 1


def test_the_worker_has_a_choice_of_its_own():
    """A thread that shares the GIL with a host thread (the run-ahead worker) measures for itself."""
    ffn, whole, _ = _ffn_weights(torch.bfloat16)
    h = torch.randn(1, 64).bfloat16()
    with torch.inference_mode():
        cpu_linear.settle(lambda: ffn.contribution(whole, h))
        with cpu_compiled.gil_kept_free():
            cpu_linear.settle(lambda: ffn.contribution(whole, h))
    assert sorted(key[-1] for key in cpu_swiglu.chosen()) == [False, True]


def test_warming_up_compiles_the_layouts_an_engine_meets():
    """After :func:`warm_up`, a whole FFN (gate and up apart or fused) and split parts of another
    size compile nothing more: a step does not stop to compile, and the eight compilations torch
    keeps per function are not spent (beyond them it would run these lines eagerly, in float32)."""
    from torch._dynamo.utils import counters

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (a thread count of its own: compilations are per thread count)
    try:
        cpu_swiglu.warm_up(torch.float16)
        before = counters["stats"]["unique_graphs"]
        for hidden, intermediate in ((128, 160), (96, 96)):
            ffn, whole, split = _ffn_weights(torch.float16, hidden=hidden, intermediate=intermediate)
            part = ffn.pieces_of(split, 0, 7)
            wider = ffn.pieces_of(split, 0, 10)["down_proj"].contiguous()  # (a wider part's copy, made at load)
            with torch.inference_mode():  # (as in a step: activations made inside it)
                for rows in (1, 5, 64):
                    h = torch.randn(rows, hidden).half()
                    for gate, up, down in ((whole["gate_proj"], whole["up_proj"], whole["down_proj"]),
                                           (*whole["gate_up_proj"].chunk(2, dim=0), whole["down_proj"]),
                                           tuple(part.values()),
                                           (part["gate_proj"], part["up_proj"], wider[:, :part["gate_proj"].shape[0]])):
                        assert cpu_swiglu.compiled(h, gate, up, down) is not None
        assert counters["stats"]["unique_graphs"] == before
    finally:
        torch.set_num_threads(threads)


def test_where_the_c_kernel_takes_ffn_work_nothing_is_compiled_or_chosen(monkeypatch):
    """Beside a GPU the C kernel computes dense FFN work up to four rows; the compiled function then
    serves no rows (above four, the projections) and warming up compiles nothing."""
    monkeypatch.setattr(cpu_swiglu.cpu_gemv, "computes", lambda rows: 1 <= rows <= 4)
    ffn, whole, _ = _ffn_weights(torch.bfloat16)
    with torch.inference_mode():
        for rows in (5, 16, 64):
            h = torch.randn(rows, 64).bfloat16()
            assert not cpu_swiglu.wanted(h)
            for _ in range(2 * cpu_swiglu.TRIALS + 2):
                torch.testing.assert_close(ffn.contribution(whole, h).float(), _reference(h, whole),
                                           rtol=2e-2, atol=2e-2)
    assert cpu_swiglu.chosen() == {} and cpu_swiglu._trials == {}
    monkeypatch.setattr(cpu_swiglu, "_warmed", set())
    cpu_swiglu.warm_up(torch.bfloat16)
    assert not cpu_swiglu._warmed  # (nothing compiled)
    monkeypatch.setattr(cpu_swiglu.cpu_gemv, "computes", lambda rows: False)  # (no kernel: the choice again)
    assert cpu_swiglu.wanted(torch.randn(16, 64).bfloat16())


def test_switched_off_the_projections_serve_every_call(monkeypatch):
    monkeypatch.setattr(cpu_swiglu, "ENABLED", False)
    ffn, whole, _ = _ffn_weights(torch.bfloat16)
    h = torch.randn(1, 64).bfloat16()
    with torch.inference_mode():
        for _ in range(2 * cpu_swiglu.TRIALS + 2):
            ffn.contribution(whole, h)
    assert cpu_swiglu.chosen() == {} and cpu_swiglu._trials == {}
