"""The CPU projection path chooser: every candidate computes F.linear's product; the choice is
measured once per shape on its first real calls, follows the timings, and can be turned off."""

import time

import pytest
import torch
import torch.nn.functional as F

from vramshard.layers import cpu_linear
from vramshard.layers.sublayer import linear


@pytest.fixture(autouse=True)
def _torch_paths(monkeypatch):
    """These paths serve one row where the C kernel does not (layers/cpu_gemv.py; VRAMSHARD_CPU_GEMV=off,
    or no compiler): it is switched off here so they run."""
    monkeypatch.setenv("VRAMSHARD_CPU_GEMV", "off")


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch, request):
    """No choices made; the compiled candidate left out except where a test asks for it."""
    if "with_compiled" not in request.keywords:
        monkeypatch.setattr(cpu_linear, "COMPILED", False)
    cpu_linear.forget()
    yield
    cpu_linear.forget()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 3, 16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_every_kernel_computes_the_projection(dtype, tokens, with_bias):
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 96, generator=g).to(dtype)
    w = (torch.randn(80, 96, generator=g) * 0.1).to(dtype)
    bias = torch.randn(80, generator=g).to(dtype) if with_bias else None
    reference = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    names = ["linear", "mv", "compiled"] if tokens == 1 else ["linear", "weight_mm"]
    for name in names:
        y = cpu_linear.KERNELS[name](x, w, bias)
        assert y.shape == (tokens, 80) and y.dtype == dtype and y.is_contiguous()
        torch.testing.assert_close(y.float(), reference, atol=0.05, rtol=0.02)
    torch.testing.assert_close(linear(x, w, bias).float(), reference, atol=0.05, rtol=0.02)


def test_the_choice_follows_the_timings_and_is_made_once(monkeypatch):
    calls = {"linear": 0, "mv": 0}

    def slow_linear(x, w, bias):
        calls["linear"] += 1
        time.sleep(0.02)  # far above a tiny projection, even on a loaded 2-core CI machine
        return F.linear(x, w, bias)

    def fast_mv(x, w, bias):
        calls["mv"] += 1
        return torch.mv(w, x[0]).unsqueeze(0)

    monkeypatch.setitem(cpu_linear.KERNELS, "linear", slow_linear)
    monkeypatch.setitem(cpu_linear.KERNELS, "mv", fast_mv)
    x, w = torch.randn(1, 64).bfloat16(), torch.randn(32, 64).bfloat16()
    reference = F.linear(x.float(), w.float())
    for _ in range(2 * cpu_linear.TRIALS - 1):  # the trials are the real calls: their results count
        torch.testing.assert_close(linear(x, w).float(), reference, atol=0.05, rtol=0.02)
    assert cpu_linear.chosen() == {} and calls == {"linear": cpu_linear.TRIALS, "mv": cpu_linear.TRIALS - 1}
    linear(x, w)
    assert list(cpu_linear.chosen().values()) == ["mv"]
    measured = dict(calls)
    for _ in range(5):
        linear(x, w)
    assert calls["mv"] == measured["mv"] + 5 and calls["linear"] == measured["linear"]  # no new measurement


def test_each_trial_reads_the_weights_of_its_call(monkeypatch):
    """Trials time the calls the model makes (each layer's own, cold weights), not one weight again."""
    seen = []
    monkeypatch.setitem(cpu_linear.KERNELS, "linear", lambda x, w, b: seen.append(w.data_ptr()) or F.linear(x, w, b))
    monkeypatch.setitem(cpu_linear.KERNELS, "mv", lambda x, w, b: seen.append(w.data_ptr()) or F.linear(x, w, b))
    layers = [torch.randn(32, 64).half() for _ in range(2 * cpu_linear.TRIALS)]
    x = torch.randn(1, 64).half()
    for w in layers:
        linear(x, w)
    assert seen == [w.data_ptr() for w in layers]


def test_linear_stays_unless_another_path_is_clearly_faster(monkeypatch):
    def slow_mv(x, w, bias):
        time.sleep(0.02)
        return torch.mv(w, x[0]).unsqueeze(0)

    monkeypatch.setitem(cpu_linear.KERNELS, "mv", slow_mv)
    x, w = torch.randn(1, 64).half(), torch.randn(32, 64).half()
    for _ in range(2 * cpu_linear.TRIALS):
        linear(x, w)
    assert list(cpu_linear.chosen().values()) == ["linear"]


def test_off_switch_float32_and_large_steps_use_f_linear(monkeypatch):
    w16, w32 = torch.randn(32, 64).bfloat16(), torch.randn(32, 64)
    linear(torch.randn(1, 64), w32)  # float32
    linear(torch.randn(cpu_linear.MAX_TOKENS + 1, 64).bfloat16(), w16)  # a prompt chunk
    assert cpu_linear.chosen() == {}
    monkeypatch.setenv("VRAMSHARD_CPU_LINEAR", "linear")
    linear(torch.randn(1, 64).bfloat16(), w16)
    assert cpu_linear.chosen() == {}


def test_threads_calling_one_shape_at_once_make_one_choice_without_error():
    """The run-ahead worker and the host thread (or a CPU share's threads) may run the same
    projection shape together while its trial is under way: every call computes, one choice stands."""
    import threading

    x = torch.randn(1, 64).to(torch.bfloat16)
    w = (torch.randn(48, 64) * 0.1).to(torch.bfloat16)
    expected = F.linear(x.float(), w.float())
    errors, start = [], threading.Barrier(4)

    def calls():
        try:
            start.wait()
            for _ in range(4 * cpu_linear.TRIALS):
                torch.testing.assert_close(cpu_linear.cpu_linear(x, w).float(), expected, atol=0.05, rtol=0.02)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=calls) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len([k for k in cpu_linear.chosen() if k[2:4] == (48, 64)]) == 1


@pytest.mark.with_compiled
def test_one_token_over_a_contiguous_weight_may_take_the_compiled_row_sums(monkeypatch):
    """Three candidates for one token over a contiguous weight, two for a transposed view, a few
    tokens, a thread that keeps the GIL free where compiled kernels hold it, or
    ``VRAMSHARD_CPU_LINEAR=aten``; the compiled one is compiled before its first timed trial and
    wins when it is the fastest."""
    from vramshard.layers import cpu_compiled

    x, w = torch.randn(1, 64).bfloat16(), torch.randn(48, 64).bfloat16()
    assert cpu_linear._candidates(x, w) == ("linear", "mv", "compiled")
    assert cpu_linear._candidates(x, torch.randn(64, 48).bfloat16().t()) == ("linear", "mv")
    sliced = torch.randn(48, 160).bfloat16()[:, 32:96]  # a split FFN part's down columns: rows contiguous
    assert cpu_linear._candidates(x, sliced) == ("linear", "mv", "compiled")
    torch.testing.assert_close(cpu_linear._compiled(x, sliced, None).float(), F.linear(x.float(), sliced.float()),
                               atol=0.05, rtol=0.02)
    assert cpu_linear._candidates(torch.randn(2, 64).bfloat16(), w) == ("linear", "weight_mm")
    with cpu_compiled.gil_kept_free():  # compiled kernels leave the GIL: a worker may run them
        assert cpu_linear._candidates(x, w) == ("linear", "mv", "compiled")
        with monkeypatch.context() as keeping:  # where they could not be made to leave it, not there
            keeping.setattr(cpu_compiled, "_RELEASES_GIL", [False])
            assert cpu_linear._candidates(x, w) == ("linear", "mv")
    monkeypatch.setenv("VRAMSHARD_CPU_LINEAR", "aten")
    assert cpu_linear._candidates(x, w) == ("linear", "mv")
    monkeypatch.delenv("VRAMSHARD_CPU_LINEAR")
    warmed = []
    real_warm_up = cpu_linear.warm_up
    monkeypatch.setattr(cpu_linear, "warm_up", lambda dtype: warmed.append(dtype) or real_warm_up(dtype))

    def slow(kernel):
        def run(x, w, bias):
            time.sleep(0.01)  # (2 ms lost once: another process held a core, and an OpenMP team waited on it)
            return kernel(x, w, bias)
        return run

    monkeypatch.setitem(cpu_linear.KERNELS, "linear", slow(cpu_linear._linear))
    monkeypatch.setitem(cpu_linear.KERNELS, "mv", slow(cpu_linear._mv))
    reference = F.linear(x.float(), w.float())
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # (a compiled kernel's team of two on a loaded 2-core machine waited past the sleep:
    try:  # a clean-clone CI run of session 47 beside other tests)
        for _ in range(3 * cpu_linear.TRIALS):
            torch.testing.assert_close(linear(x, w).float(), reference, atol=0.05, rtol=0.02)
    finally:
        torch.set_num_threads(before)
    assert list(cpu_linear.chosen().values()) == ["compiled"] and warmed and set(warmed) == {torch.bfloat16}


@pytest.mark.with_compiled
def test_after_the_warm_up_a_steps_projections_compile_nothing(monkeypatch):
    """The warm-up makes its tensors as a step has them (weights outside inference mode, activations
    inside), for whole weights and column slices: the first step's calls compile nothing more."""
    from torch._dynamo.utils import counters

    from vramshard.layers.cpu_compiled import CompiledKernel

    # As in a fresh process: no warm-up done, no kernel compiled (an earlier test's dynamo reset would
    # have dropped the compilations that the warm-up's record still counts).
    monkeypatch.setattr(cpu_linear, "_warmed", set())
    for name in ("_GEMV", "_GEMV_SLICED"):
        kernel = getattr(cpu_linear, name)
        monkeypatch.setattr(cpu_linear, name, CompiledKernel(kernel.fn, kernel.what, kernel.fallback))
    cpu_linear.warm_up(torch.bfloat16)
    weight = torch.randn(96, 5000).bfloat16()  # a model's weight: made outside inference mode
    compiled = counters["stats"]["unique_graphs"]
    with torch.inference_mode():
        for w in (weight, weight[:, :3000], weight[:, 3000:], weight[:, :4500]):
            x = torch.randn(1, w.shape[1]).bfloat16()
            torch.testing.assert_close(cpu_linear._compiled(x, w, None).float(), F.linear(x.float(), w.float()),
                                       atol=0.1, rtol=0.02)
    assert counters["stats"]["unique_graphs"] == compiled


@pytest.mark.parametrize("tokens", [1, 3])
def test_a_benchmark_of_a_shape_times_its_chosen_path_not_the_trials(monkeypatch, tokens):
    """The profile's matmul timings (``linear_over``) start after the shape's choice is made: timed
    before it, a point took the trial calls (and a compilation) for its time."""
    from vramshard.profile.bench_matmul import linear_over

    trials = []
    monkeypatch.setattr(cpu_linear, "_trial", lambda *a, _real=cpu_linear._trial: trials.append(1) or _real(*a))
    weights = [torch.randn(48, 64).bfloat16() for _ in range(3)]  # cold copies
    x = torch.randn(tokens, 64).bfloat16()
    fn = linear_over(x, weights)
    candidates = ("linear", "mv") if tokens == 1 else ("linear", "weight_mm")
    assert list(cpu_linear.chosen()) == [(torch.bfloat16, tokens, 48, 64, torch.get_num_threads(), False, candidates)]
    assert len(trials) == len(candidates) * cpu_linear.TRIALS
    fn()
    assert len(trials) == len(candidates) * cpu_linear.TRIALS  # the timed calls run the chosen path


def test_settling_a_call_waits_for_its_own_shapes_only():
    """A shape left on trial by earlier calls does not keep ``settle`` calling (a whole FFN: each of
    its projections is chosen, and then it stops)."""
    left = torch.randn(1, 32).half()
    linear(left, torch.randn(16, 32).half())  # one trial of another shape, never finished
    w1, w2 = torch.randn(48, 64).bfloat16(), torch.randn(64, 48).bfloat16()
    x = torch.randn(2, 64).bfloat16()
    calls = []
    cpu_linear.settle(lambda: calls.append(1) or linear(linear(x, w1), w2))
    assert len(calls) == 2 * cpu_linear.TRIALS  # the trials' calls, and none after the choice
    assert len(cpu_linear.chosen()) == 2 and len(cpu_linear._trials) == 1
    cpu_linear.settle(lambda: calls.append(1) or F.linear(x.float(), w1.float()))  # float32: nothing to choose
    assert len(calls) == 2 * cpu_linear.TRIALS + 1
