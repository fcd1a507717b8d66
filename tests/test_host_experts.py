"""A few tokens' routed experts on the CPU in one compiled pass (``layers/host_experts``): against
the expert-by-expert path in float32, shares of a step's assignments, where it does not apply, its
fallback when compiling fails, and a bfloat16 engine on the CPU that runs on it. The C kernel that
takes the pass's place where it builds is switched off here unless a test asks for it (its own
tests: test_cpu_gemv.py)."""

import logging
import re

import pytest
import torch

from vramshard import Engine
from vramshard.layers import cpu_compiled, cpu_gemv, cpu_swiglu, host_experts
from vramshard.layers.cpu_compiled import CompiledKernel
from vramshard.layers.moe import DictExperts, MoEFFN, Routing
from vramshard.loading.checkpoint import open_checkpoint
from vramshard.models import build_model
from vramshard.runtime.host_weights import pack_model
from vramshard.runtime.weights import load_weights

from placement_helpers import PROMPT

MOE_ARCHS = ["qwen3_moe", "mixtral", "qwen2_moe", "olmoe"]


def bf16_layer(tiny_model_dir, arch):
    """The first MoE ``ffn`` of the tiny bfloat16 model, its packed host views, and float32 copies."""
    path = tiny_model_dir(arch, torch.bfloat16)
    model = build_model(open_checkpoint(path).config, dtype=torch.bfloat16)
    host = pack_model(list(model), load_weights(model, open_checkpoint(path)), pin=False)
    ffn = next(s for s in model if isinstance(s, MoEFFN))
    views = host[ffn.name].views
    assert views["router"].dtype == torch.bfloat16
    plain32 = {k: v.float() for k, v in views.items() if not k.endswith("gate_up")}
    return ffn, views, plain32


def needs_c_kernel() -> None:
    """Skip where the C kernel cannot be built (no C compiler); where there is a compiler, a failed
    build fails the test (CI has one)."""
    if cpu_gemv.library() is None:
        assert cpu_gemv._compiler() is None, f"the C kernel does not build here: {cpu_gemv.failure()}"
        pytest.skip("no C compiler here: the C kernel serves nowhere on this machine")


@pytest.fixture(autouse=True)
def compiled_pass(monkeypatch):
    """The compiled pass, not the C kernel (a test that wants the kernel sets the switch again)."""
    monkeypatch.setenv("VRAMSHARD_CPU_GEMV", "off")


@pytest.fixture
def calls(monkeypatch):
    """The kernel's calls that computed a result (not None)."""
    made = []
    real = host_experts.routed

    def spy(*args, **kwargs):
        y = real(*args, **kwargs)
        if y is not None:
            made.append(args[0].shape[0])
        return y

    monkeypatch.setattr(host_experts, "routed", spy)
    return made


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_compiled_pass_matches_the_expert_by_expert_path_in_float32(arch, tiny_model_dir, calls):
    ffn, views, plain32 = bf16_layer(tiny_model_dir, arch)
    source = DictExperts(views, ffn.num_experts, stack=True)
    assert source.stacked() is not None
    torch.manual_seed(0)
    for tokens in (1, 3, host_experts.ROWS):
        x = torch.randn(tokens, ffn.hidden).to(torch.bfloat16)
        h, routing = ffn.prepare(views, x)
        got = ffn.run_experts(source, h, routing)
        assert got.dtype == torch.bfloat16 and got.shape == h.shape
        expected = ffn.run_experts(DictExperts(plain32, ffn.num_experts), h.float(), routing)
        scale = expected.abs().max().item()
        torch.testing.assert_close(got.float(), expected, rtol=0, atol=2e-2 * scale)
    assert calls == [1, 3, host_experts.ROWS]


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_shares_of_the_assignments_sum_to_the_whole(arch, tiny_model_dir, calls):
    ffn, views, _ = bf16_layer(tiny_model_dir, arch)
    source = DictExperts(views, ffn.num_experts, stack=True)
    torch.manual_seed(1)
    x = torch.randn(5, ffn.hidden).to(torch.bfloat16)
    h, routing = ffn.prepare(views, x)
    used = sorted(set(routing.experts.reshape(-1).tolist()))
    first, rest = set(used[: len(used) // 2]), set(used[len(used) // 2 :])
    whole = ffn.run_experts(source, h, routing).float()
    parts = ffn.run_experts(source, h, routing, only=first).float() + ffn.run_experts(source, h, routing, only=rest).float()
    torch.testing.assert_close(parts, whole, rtol=0, atol=2e-2 * whole.abs().max().item())
    assert torch.count_nonzero(ffn.run_experts(source, h, routing, only=set())) == 0
    assert len(calls) == 4
    first_of, rest_of = (Routing(routing.experts[:, part], routing.weights[:, part])  # by routing position
                         for part in (slice(0, 1), slice(1, None)))
    parts = ffn.run_experts(source, h, first_of).float() + ffn.run_experts(source, h, rest_of).float()
    torch.testing.assert_close(parts, whole, rtol=0, atol=2e-2 * whole.abs().max().item())
    assert len(calls) == 6


def test_where_it_does_not_apply_the_caller_computes(tiny_model_dir):
    ffn, views, plain32 = bf16_layer(tiny_model_dir, "qwen3_moe")
    stacked = DictExperts(views, ffn.num_experts, stack=True).stacked()
    routing_of = lambda rows: ffn.prepare(views, torch.randn(rows, ffn.hidden).to(torch.bfloat16))  # noqa: E731
    h, routing = routing_of(host_experts.ROWS + 1)  # a prompt chunk: the grouped path reads each expert once
    assert host_experts.routed(h, stacked.gate_up, stacked.down, routing.experts, routing.weights) is None
    stacked32 = DictExperts(plain32, ffn.num_experts, stack=True).stacked()
    assert stacked32 is None  # (separate tensors: nothing to stack)
    h, routing = routing_of(1)
    g32, d32 = stacked.gate_up.float(), stacked.down.float()
    assert host_experts.routed(h.float(), g32, d32, routing.experts, routing.weights) is None  # float32


def test_a_failed_compile_falls_back_to_the_expert_by_expert_path(tiny_model_dir, monkeypatch, caplog):
    ffn, views, plain32 = bf16_layer(tiny_model_dir, "qwen3_moe")
    source = DictExperts(views, ffn.num_experts, stack=True)
    def no_compiler(*args):
        raise RuntimeError("no C++ compiler found\nmore detail")

    monkeypatch.setattr(cpu_compiled, "_trust_isa_flags", True)  # (the failure withdraws it: restored after)
    # (each expert's SwiGLU then on the projections alone: the dense choice's trials alternate ways,
    # whose roundings differ, and the two calls below are compared bit for bit)
    monkeypatch.setattr(cpu_swiglu, "COMPILED", False)
    for form in ("_kernel", "_kernel_by_assignment"):  # (either may run, as the assignments share out)
        monkeypatch.setattr(host_experts, form, CompiledKernel(no_compiler, "routed experts", "run expert by expert"))
    x = torch.randn(2, ffn.hidden).to(torch.bfloat16)
    h, routing = ffn.prepare(views, x)
    with caplog.at_level(logging.WARNING, logger="vramshard.layers.cpu_compiled"):
        got = ffn.run_experts(source, h, routing)
        again = ffn.run_experts(source, h, routing)
    assert [r.getMessage() for r in caplog.records].count(
        "routed experts on the CPU run expert by expert: compiling their kernel failed "
        "(RuntimeError: no C++ compiler found)") == 1  # said once
    assert not host_experts.eligible(h, views["experts.0.gate_up"][None])
    expected = ffn.run_experts(DictExperts(plain32, ffn.num_experts), h.float(), routing)
    torch.testing.assert_close(got.float(), expected, rtol=0, atol=2e-2 * expected.abs().max().item())
    assert torch.equal(got, again)


@pytest.mark.parametrize("kernel", ["compiled", "C"])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_a_bfloat16_cpu_engine_decodes_on_it(arch, kernel, tiny_model_dir, calls, monkeypatch):
    """Greedy decode and prompt logits of the bfloat16 engine on the CPU, against its float32 run:
    the pass is compiled at load (the C kernel needs nothing), and the one-token steps take it."""
    if kernel == "C":
        needs_c_kernel()
        monkeypatch.setenv("VRAMSHARD_CPU_GEMV", "on")
    path = tiny_model_dir(arch, torch.bfloat16)
    warmed = []
    real_warm_up = host_experts.warm_up
    monkeypatch.setattr(host_experts, "warm_up", lambda *a: warmed.append(a[0].dtype) or real_warm_up(*a))
    engine = Engine.load(path, device="cpu", dtype="bfloat16")
    assert warmed and set(warmed) == {torch.bfloat16}
    reference = Engine.load(path, device="cpu", dtype="float32")
    assert set(warmed) == {torch.bfloat16}  # float32 keeps the expert-by-expert path: nothing to compile
    got = engine.logits(PROMPT[:host_experts.ROWS])
    expected = reference.logits(PROMPT[:host_experts.ROWS])
    torch.testing.assert_close(got, expected, rtol=0, atol=3e-2 * expected.abs().max().item())
    calls.clear()
    engine.generate([PROMPT[:5]], 4)
    moe_layers = sum(isinstance(s, MoEFFN) for s in engine.model)
    assert calls.count(1) >= 3 * moe_layers  # the decode steps after the prompt


def test_a_thread_that_keeps_the_gil_free_computes_expert_by_expert_where_kernels_hold_it(tiny_model_dir, calls,
                                                                                          monkeypatch):
    """Where inductor's kernels hold the GIL (their binding could not be changed), inside
    ``gil_kept_free`` (the run-ahead worker) the pass does not run, and the result is the same; where
    they leave it (the default), the worker runs the pass too."""
    ffn, views, _ = bf16_layer(tiny_model_dir, "qwen3_moe")
    source = DictExperts(views, ffn.num_experts, stack=True)
    h, routing = ffn.prepare(views, torch.randn(2, ffn.hidden).to(torch.bfloat16))
    with monkeypatch.context() as keeping:
        keeping.setattr(cpu_compiled, "_RELEASES_GIL", [False])
        with cpu_compiled.gil_kept_free():
            assert not cpu_compiled.allowed()
            kept = ffn.run_experts(source, h, routing)
        assert cpu_compiled.allowed() and calls == []
    compiled = ffn.run_experts(source, h, routing)
    assert calls == [2]
    torch.testing.assert_close(kept.float(), compiled.float(), rtol=0, atol=2e-2 * compiled.float().abs().max().item())
    assert cpu_compiled.kernels_release_gil()
    with cpu_compiled.gil_kept_free():
        assert cpu_compiled.allowed()
        on_worker = ffn.run_experts(source, h, routing)
    assert calls == [2, 2]
    torch.testing.assert_close(on_worker, compiled)


def test_each_dtype_gets_a_compilation_of_its_own_and_thread_counts_share_it(monkeypatch):
    """torch runs a function eagerly past 8 compilations of its code: every dtype compiles its own
    copy, so a profile's sweep never falls back. Kernels that read the thread count when they run
    serve every count from one compilation; where they keep the count they were compiled for, each
    (dtype, threads) pair has its own."""
    before = torch.get_num_threads()
    counts = sorted({1, 2, before})
    for reads_at_run_time in (True, False):
        monkeypatch.setattr(cpu_compiled, "kernels_read_threads_at_run_time", lambda: reads_at_run_time)
        kernel = CompiledKernel(lambda x: (x.float() * 2).sum(-1), "test sums", "run eagerly")
        try:
            for threads in counts:
                torch.set_num_threads(threads)
                for dtype in host_experts.DTYPES:
                    assert torch.equal(kernel(torch.ones(3, 4, dtype=dtype)), torch.full((3,), 8.0))
        finally:
            torch.set_num_threads(before)
        per_dtype = len(host_experts.DTYPES)
        assert len(kernel._compiled) == (per_dtype if reads_at_run_time else per_dtype * len(counts))
        assert kernel.failed is None


def _stacked_layer(experts=16, hidden=256, inter=128, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.05).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=g) * 0.05).to(dtype)
    return gate_up, down


ONE_TOKEN_FORMS = {False: "_one_token_kernel", True: "_one_token_kernel_by_assignment"}


@pytest.mark.parametrize("by_assignment", [False, True])
def test_one_token_is_one_compiled_call_with_the_several_token_passes_result(monkeypatch, by_assignment):
    """Without the C kernel, a decode step's routed experts: the whole weighted sum in one compiled
    function (its glue around the kernel was a dozen torch calls, each taking the GIL back on the
    run-ahead worker), in either form (row-parallel, or by assignment where the assignments share out
    evenly)."""
    monkeypatch.setenv("VRAMSHARD_CPU_GEMV", "off")
    gate_up, down = _stacked_layer()
    one_token_calls = []
    monkeypatch.setattr(host_experts, "by_assignment", lambda assignments, threads=None: by_assignment)
    real = getattr(host_experts, ONE_TOKEN_FORMS[by_assignment])

    class Spy:
        failed = None

        def __call__(self, *args):
            one_token_calls.append(args[0].shape)
            return real(*args)

    monkeypatch.setattr(host_experts, ONE_TOKEN_FORMS[by_assignment], Spy())
    with torch.inference_mode():
        h = torch.randn(1, 256).bfloat16()
        experts, weights = torch.tensor([[3, 11, 0, 7]]), torch.tensor([[0.4, 0.3, 0.2, 0.1]]).bfloat16()
        one = host_experts.routed(h, gate_up, down, experts, weights)
        several = host_experts.routed(h, gate_up, down, experts, weights, torch.ones(1, 4, dtype=torch.bool))
    assert one_token_calls == [(1, 256)]  # the all-True mask took the several-token pass
    assert one.dtype == torch.bfloat16 and one.shape == (1, 256)
    torch.testing.assert_close(one.float(), several.float(), rtol=0, atol=1e-2 * several.abs().max().item())


def test_each_thread_counts_its_own_time_in_the_one_token_call(monkeypatch):
    """``kernel_seconds``: this thread's time in the one-token compiled call (the run-ahead worker
    reports it per step beside its parts' whole computing); the several-token pass and other
    threads add nothing to it."""
    monkeypatch.setenv("VRAMSHARD_CPU_GEMV", "off")
    import threading
    import time

    gate_up, down = _stacked_layer()
    monkeypatch.setattr(host_experts, "by_assignment", lambda assignments, threads=None: False)
    real = host_experts._one_token_kernel

    class Slow:
        failed = None

        def __call__(self, *args):
            time.sleep(0.05)
            return real(*args)

    experts, weights = torch.tensor([[3, 11, 0, 7]]), torch.tensor([[0.4, 0.3, 0.2, 0.1]]).bfloat16()
    with torch.inference_mode():
        h = torch.randn(1, 256).bfloat16()
        assert host_experts.routed(h, gate_up, down, experts, weights) is not None  # (compiled now)
        monkeypatch.setattr(host_experts, "_one_token_kernel", Slow())
        before = host_experts.kernel_seconds()
        host_experts.routed(h, gate_up, down, experts, weights)
        spent = host_experts.kernel_seconds() - before
        host_experts.routed(h, gate_up, down, experts, weights, torch.ones(1, 4, dtype=torch.bool))
        assert host_experts.kernel_seconds() - before == spent
    assert spent >= 0.05
    elsewhere = []
    thread = threading.Thread(target=lambda: elsewhere.append(host_experts.kernel_seconds()))
    thread.start()
    thread.join()
    assert elsewhere == [0.0]


def _torch_calls(run) -> list[str]:
    """The calls into torch's C++ that ``run()`` makes from Python and that may give the GIL up:
    tensor operations and the compiled kernels' allocations and launches, not reads of a tensor's
    sizes, strides or address."""
    import sys

    reads = {"Tensor.size", "Tensor.stride", "Tensor.numel", "Tensor.dim", "Tensor.data_ptr"}
    calls: list[str] = []

    def profile(frame, event, arg):
        name = getattr(arg, "__qualname__", "")
        if event == "c_call" and name not in reads and (
                name.startswith(("Tensor.", "_VariableFunctionsClass.", "_empty_strided")) or name == "kernel"):
            calls.append(name)

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls


@pytest.mark.parametrize("kernel", ["C", "compiled"])
def test_a_token_s_experts_make_far_fewer_calls_that_give_the_gil_up(monkeypatch, kernel):
    """Each torch call gives the GIL up and must take it back, and beside a thread running Python
    (the host thread queuing a step) each take waits for the switch interval. The one-token pass
    makes few such calls, the several-token pass a dozen or more (with torch 2.13: the compiled
    one-token call 7, the several-token pass of two tokens 15); the C kernel's call one, at any tokens."""
    if kernel == "C":
        needs_c_kernel()
    monkeypatch.setenv("VRAMSHARD_CPU_GEMV", "on" if kernel == "C" else "off")
    gate_up, down = _stacked_layer()
    experts, weights = torch.tensor([[3, 11, 0, 7]]), torch.tensor([[0.4, 0.3, 0.2, 0.1]]).bfloat16()
    with torch.inference_mode():
        h = torch.randn(1, 256).bfloat16()
        two = (h.expand(2, -1).contiguous(), gate_up, down, experts.expand(2, -1), weights.expand(2, -1))
        assert host_experts.routed(h, gate_up, down, experts, weights) is not None  # (compiled now)
        assert host_experts.routed(*two) is not None
        one = _torch_calls(lambda: host_experts.routed(h, gate_up, down, experts, weights))
        several = _torch_calls(lambda: host_experts.routed(*two))
    if kernel == "C":  # one call whatever the tokens: the output's allocation
        assert one == several == ["_VariableFunctionsClass.empty"], (one, several)
    else:
        assert "kernel" in one and "kernel" in several  # (the compiled passes ran, and were counted)
        assert len(one) < 0.5 * len(several), (one, several)


def _parallel_loop_extents(code: str) -> list[str]:
    """The trip counts of the OpenMP-parallel loops in inductor's C++ for a CPU graph."""
    return re.findall(r"#pragma omp for[^\n]*\n\s*for\(int64_t x0=[^;]*; x0<static_cast<int64_t>\(([^;]*)\);", code)


@pytest.mark.parametrize("kernel", ["one token", "several tokens"])
def test_the_passes_parallel_loops_run_over_every_assignments_rows(kernel, monkeypatch):
    """Inductor picks a loop nest's parallel depth from the sizes and thread count it compiles for,
    and the compiled code then serves every size and team (its cache ignores the count when threads
    are read at run time). Written as a reduction per (assignment, row), the pass compiled from a tiny
    layer at 16 threads ran in parallel over the assignments alone: a real layer's 8 experts kept 8
    threads busy, a share of 3 kept 3. Each product's parallel loop must run over the assignments'
    rows together (A·2F, A·D): its trip count is a product of sizes."""
    import types

    from torch._inductor.graph import GraphLowering

    from vramshard.layers.cpu_compiled import compile_settings

    if not hasattr(GraphLowering, "save_output_code"):
        pytest.skip("this torch's inductor hands its generated code to no hook")
    # The generated C++, as torch's run_and_get_code reads it but without its dynamo reset: that drops
    # every kernel compiled so far, which later tests' warm-ups count on (their compile caches say done).
    codes = []
    monkeypatch.setattr(GraphLowering, "save_output_code", staticmethod(codes.append))
    cpu_compiled.kernels_read_threads_at_run_time()
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)  # (compile here, not from the cache)

    def fresh(fn):  # a copy of the pass's code: dynamo compiles it anew whatever ran before
        return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)

    torch.manual_seed(0)
    experts, inter, hidden = 16, 32, 48
    gate_up = (torch.randn(experts, 2 * inter, hidden) * 0.02).to(torch.bfloat16)
    down = (torch.randn(experts, hidden, inter) * 0.02).to(torch.bfloat16)
    chosen = torch.tensor([3, 11])
    threads = torch.get_num_threads()
    torch.set_num_threads(16)
    try:
        settings, _ = compile_settings()
        with settings, torch.inference_mode():
            if kernel == "one token":
                fn = torch.compile(fresh(host_experts._one_token), dynamic=True)
                args = (torch.randn(1, hidden), gate_up, down, chosen[None], torch.full((1, 2), 0.5, dtype=torch.bfloat16))
            else:
                fn = torch.compile(fresh(host_experts._assigned_swiglu), dynamic=True)
                args = (torch.randn(2, hidden), gate_up, down, chosen)
            try:
                fn(*args)
            except Exception as exc:  # noqa: BLE001 - no C++ compiler here: nothing is compiled to read
                pytest.skip(f"the pass does not compile here: {type(exc).__name__}")
    finally:
        torch.set_num_threads(threads)
    extents = [e for code in codes for e in _parallel_loop_extents(code)]
    assert extents, "no OpenMP-parallel loop found in the pass's C++ (or a form this test no longer reads)"
    assert sum("*" in e for e in extents) >= 2, f"parallel loops over {extents}: not over every assignment's rows"


def test_the_form_by_assignment_only_where_the_assignments_share_out_evenly():
    assert host_experts.by_assignment(8, 2) and host_experts.by_assignment(128, 16)  # 4 each; 8 of 8.0
    assert not host_experts.by_assignment(8, 15)  # 7 threads idle
    assert not host_experts.by_assignment(3, 2)  # one thread does two, the other one
    assert not host_experts.by_assignment(32, 15)  # 3 on the busiest against 2.13 on average
    assert host_experts.by_assignment(1, 1)


def test_a_tokens_experts_kept_or_not_go_through_the_c_kernel_as_the_several_token_pass(monkeypatch):
    """One token, all its experts or a share (the CPU's beside the GPU's zero-copy kernels): one C call,
    the several-token compiled pass's sums within one rounding, and its time counted as the kernel's."""
    needs_c_kernel()
    monkeypatch.setenv("VRAMSHARD_CPU_GEMV", "on")
    gate_up, down = _stacked_layer()
    calls = []
    real = cpu_gemv.routed_experts
    monkeypatch.setattr(cpu_gemv, "routed_experts", lambda *args: calls.append(len(args)) or real(*args))
    experts, weights = torch.tensor([[3, 11, 0, 7]]), torch.tensor([[0.4, 0.3, 0.2, 0.1]]).bfloat16()
    with torch.inference_mode():
        h = torch.randn(1, 256).bfloat16()
        for keep in (None, torch.tensor([[True, False, True, False]])):
            before = host_experts.kernel_seconds()
            ours = host_experts.routed(h, gate_up, down, experts, weights, keep)
            assert host_experts.kernel_seconds() > before
            monkeypatch.setenv("VRAMSHARD_CPU_GEMV", "off")
            several = host_experts.routed(h.expand(2, -1).contiguous(), gate_up, down, experts.expand(2, -1),
                                          weights.expand(2, -1), None if keep is None else keep.expand(2, -1))
            monkeypatch.setenv("VRAMSHARD_CPU_GEMV", "on")
            torch.testing.assert_close(ours.float(), several[:1].float(), rtol=0,
                                       atol=1e-2 * several.abs().max().item())
    assert len(calls) == 2

