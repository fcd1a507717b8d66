"""The C kernel for one-row half-precision products (layers/cpu_gemv.py, VRAMSHARD_CPU_GEMV): every build
of it (AVX-512, AVX2 + F16C, plain C) computes x @ W.T as float64 does, column slices of a wider weight
included; it is used unless switched off and where it builds, else torch's paths; one-row
FFNs, split parts and projections through it give an engine the logits of the float32 CPU reference, with
no prepacked or row-major copies of the parts."""

import copy
import platform

import pytest
import torch

from vramshard import Engine
from vramshard.layers import cpu_gemv, cpu_linear
from vramshard.layers.mlp import swiglu
from vramshard.runtime import cpu_packed

from kernel_helpers import ON_CI, needs_kernel
from placement_helpers import PROMPT, trace_logits
from test_split_ffn import _ffn, _split_placement, _whole

NARROWER = {"avx2": ("-mno-avx512f",), "plain": ("-mno-avx512f", "-mno-avx2", "-mno-f16c", "-mno-fma")}


def _build(isa: str):
    if isa == "native":
        return cpu_gemv.library()
    try:
        return cpu_gemv._load(cpu_gemv.FLAGS + NARROWER[isa])
    except RuntimeError as exc:  # (a compiler without these x86 flags: another architecture)
        if ON_CI and platform.machine() in ("x86_64", "AMD64"):
            raise
        pytest.skip(f"no {isa} build here: {exc}")


@needs_kernel
@pytest.mark.parametrize("isa", ["native", "avx2", "plain"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_build_computes_the_rows_times_the_weight(isa, dtype):
    lib = _build(isa)
    g = torch.Generator().manual_seed(0)
    for rows in (1, 2, 3, 4, 5, 16):
        # (N, K): blocks of four rows and a remainder; K past the vector widths and a tail; a short K
        for n, k in ((37, 4101), (64, 32), (5, 7), (1, 1)):
            wide = torch.randn(n, k + 13, generator=g).to(dtype)
            for w in (wide[:, :k].contiguous(), wide[:, 5:5 + k]):  # a whole weight, a column slice
                x = torch.randn(rows, k, generator=g).to(dtype)
                y = cpu_gemv.rows_times_weight(x, w, lib=lib)
                expected = x.double() @ w.double().T
                assert y.dtype == torch.float32 and y.shape == (rows, n)
                torch.testing.assert_close(y.double(), expected, rtol=0, atol=2e-5 * expected.abs().max().item() + 1e-6)
            # Stored transposed (w.T [K, N] by rows, a run of rows of a longer one): up to four rows of x.
            if rows > cpu_gemv.COLUMN_ROWS:
                continue
            stored = torch.randn(k + 9, n + 3, generator=g).to(dtype)
            w = stored[4:4 + k, 2:2 + n].t()  # [N, K], unit row stride
            x = torch.randn(rows, k, generator=g).to(dtype)
            expected = x.double() @ w.double().T
            y = cpu_gemv.rows_times_weight(x, w, lib=lib)
            assert y.shape == (rows, n)
            torch.testing.assert_close(y.double(), expected, rtol=0, atol=2e-5 * expected.abs().max().item() + 1e-6)


def _swiglu_reference(x, gate, up, down):
    """A SwiGLU in float64, the activation rounded once to the dtype as the kernel does."""
    act = (torch.nn.functional.silu(x.double() @ gate.double().T) * (x.double() @ up.double().T)).to(x.dtype)
    return act.double() @ down.double().T


@needs_kernel
@pytest.mark.parametrize("isa", ["native", "avx2", "plain"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_build_computes_a_swiglu_part_in_one_call(isa, dtype):
    """vs_swiglu (cpu_gemv.swiglu's one call): gate and up row slices of wider weights, down a column slice
    (by rows) or stored transposed (a split FFN's), for up to four rows, as float64 does with the activation
    rounded once; what it refuses it refuses with -1."""
    lib = _build(isa)
    g = torch.Generator().manual_seed(5)
    hidden, width = 70, 37  # past the vector widths, with tails; blocks of four rows and a remainder
    wide = torch.randn(2 * width + 6, hidden, generator=g).to(dtype) * 0.2
    gate, up = wide[:width], wide[width + 3 : 2 * width + 3]
    by_rows = (torch.randn(hidden, width + 9, generator=g).to(dtype) * 0.2)[:, 4 : 4 + width]
    stored = (torch.randn(width + 5, hidden + 2, generator=g).to(dtype) * 0.2)[2 : 2 + width, 1 : 1 + hidden]
    for down in (by_rows, stored.t()):
        for rows in (1, 2, 4):
            x = torch.randn(rows, hidden, generator=g).to(dtype)
            out = torch.full((rows, hidden), 7.0, dtype=dtype)
            assert lib.vs_swiglu(*cpu_gemv._swiglu_args(x, gate, up, down, out), 3) == 0
            expected = _swiglu_reference(x, gate, up, down)
            torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-2 * expected.abs().max().item())
            # each row's sums are the same whatever rows come with it
            one = torch.empty(1, hidden, dtype=dtype)
            assert lib.vs_swiglu(*cpu_gemv._swiglu_args(x[-1:].clone(), gate, up, down, one), 3) == 0
            assert torch.equal(one, out[-1:])
    x, out = torch.randn(5, hidden).to(dtype), torch.empty(5, hidden, dtype=dtype)
    assert lib.vs_swiglu(*cpu_gemv._swiglu_args(x, gate, up, stored.t(), out), 2) == -1  # transposed: four rows
    assert lib.vs_swiglu(*cpu_gemv._swiglu_args(x, gate, up, by_rows, out), 2) == 0


def _routed_reference(x, gate_up, down, experts, weights, keep=None):
    """A few tokens' routed experts in float64, the activation rounded once to the dtype as the kernel does."""
    width = gate_up.shape[1] // 2
    y = torch.zeros(x.shape, dtype=torch.float64)
    kept = torch.ones(experts.shape, dtype=torch.bool) if keep is None else keep
    for t in range(x.shape[0]):
        for e, w, computed in zip(experts[t].tolist(), weights[t].double().tolist(), kept[t].tolist()):
            if computed:
                both = x[t : t + 1].double() @ gate_up[e].double().T
                act = (torch.nn.functional.silu(both[:, :width]) * both[:, width:]).to(x.dtype)
                y[t] += (w * (act.double() @ down[e].double().T))[0]
    return y


@needs_kernel
@pytest.mark.parametrize("isa", ["native", "avx2", "plain"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_build_computes_the_tokens_routed_experts(isa, dtype):
    """Over stacked experts as a host layout holds them (experts and rows at strides past their
    sizes), one to sixteen tokens sharing some experts, routing weights in the dtype or float32,
    experts in any order, all or some of them kept: each token's weighted sum of its kept routed
    experts' SwiGLUs, rounded once."""
    lib = _build(isa)
    g = torch.Generator().manual_seed(0)
    for E, width, hidden, k in ((9, 37, 101, 4), (128, 24, 64, 8), (3, 1, 5, 1), (6, 8, 33, 6)):
        gate_up = torch.randn(E + 1, 2 * width, hidden + 3, generator=g).to(dtype)[1:, :, 2:2 + hidden]
        down = torch.randn(E, hidden, width + 5, generator=g).to(dtype)[:, :, :width]
        for tokens in (1, 3, 16):
            x = torch.randn(tokens, hidden, generator=g).to(dtype)
            experts = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])
            some = torch.rand(tokens, k, generator=g) < 0.5  # (a CPU share: the others computed elsewhere)
            none = torch.zeros(tokens, k, dtype=torch.bool)
            for weights, keep in ((torch.rand(tokens, k, generator=g).to(dtype), None),
                                  (torch.rand(tokens, k, generator=g), None),
                                  (torch.rand(tokens, k, generator=g).to(dtype), some),
                                  (torch.rand(tokens, k, generator=g), none)):
                assert cpu_gemv.serves_experts(x, gate_up, down, experts, weights, keep)
                y = cpu_gemv.routed_experts(x, gate_up, down, experts, weights, keep, lib=lib)
                expected = _routed_reference(x, gate_up, down, experts, weights, keep)
                assert y.dtype == dtype and y.shape == (tokens, hidden)
                torch.testing.assert_close(y.double(), expected.to(dtype).double(), rtol=0,
                                           atol=1e-3 * expected.abs().max().item() + 1e-6)  # (one rounding apart)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 3, 7])
def test_the_experts_kernel_shares_its_output_rows_over_any_team(threads):
    """The down products' output rows shared out over teams that do not divide them (and runs of more rows
    than a thread sums at a time): every row computed once, by one thread."""
    g = torch.Generator().manual_seed(1)
    E, width, hidden, k = (5, 16, 421, 3)
    gate_up = torch.randn(E, 2 * width, hidden, generator=g).to(torch.bfloat16)
    down = torch.randn(E, hidden, width, generator=g).to(torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for tokens in (1, 5):
            x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
            experts = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])
            weights = torch.rand(tokens, k, generator=g)
            y = cpu_gemv.routed_experts(x, gate_up, down, experts, weights)
            expected = _routed_reference(x, gate_up, down, experts, weights)
            torch.testing.assert_close(y.double(), expected.to(torch.bfloat16).double(), rtol=0,
                                       atol=1e-3 * expected.abs().max().item() + 1e-6)
    finally:
        torch.set_num_threads(before)


def test_what_the_experts_kernel_takes_and_refuses():
    gate_up, down = torch.zeros(4, 16, 8, dtype=torch.bfloat16), torch.zeros(4, 8, 8, dtype=torch.bfloat16)
    x, experts, weights = torch.zeros(1, 8, dtype=torch.bfloat16), torch.tensor([[0, 3]]), torch.ones(1, 2)
    built = cpu_gemv.library() is not None
    assert cpu_gemv.serves_experts(x, gate_up, down, experts, weights) == built
    assert not cpu_gemv.serves_experts(x.float(), gate_up.float(), down.float())  # float32: torch's paths
    assert not cpu_gemv.serves_experts(torch.zeros(17, 8, dtype=torch.bfloat16), gate_up, down)  # 16 tokens at most
    assert not cpu_gemv.serves_experts(torch.zeros(2, 8, dtype=torch.bfloat16), gate_up, down, experts)  # [T, k]
    assert not cpu_gemv.serves_experts(torch.zeros(2, 16, dtype=torch.bfloat16)[:, ::2], gate_up, down)  # strided
    assert not cpu_gemv.serves_experts(x, gate_up, down.transpose(1, 2))  # rows not contiguous
    assert not cpu_gemv.serves_experts(x, gate_up, down[:, :, :4])  # down's width is not gate_up's half
    assert not cpu_gemv.serves_experts(x, gate_up, down, experts.int(), weights)  # int32 experts
    assert not cpu_gemv.serves_experts(x, gate_up, down, experts, weights.double())  # float64 weights
    assert not cpu_gemv.serves_experts(x, gate_up, down, experts, torch.ones(1, 3))  # one weight per expert
    assert not cpu_gemv.serves_experts(x, gate_up, down, experts, weights, torch.ones(1, 2))  # keep: a bool mask
    assert not cpu_gemv.serves_experts(x, gate_up, down, experts, weights, torch.ones(1, 3, dtype=torch.bool))
    if built:
        with pytest.raises(ValueError, match="refused the routed experts"):  # the C side's own guard
            cpu_gemv.routed_experts(x, gate_up, down, torch.tensor([[0, 4]]), weights)


def test_what_the_kernel_takes_and_the_arguments_it_refuses():
    w = torch.zeros(8, 16, dtype=torch.bfloat16)
    x = torch.zeros(1, 16, dtype=torch.bfloat16)
    assert cpu_gemv.takes(x, w) and cpu_gemv.takes(x, torch.zeros(8, 40, dtype=torch.bfloat16)[:, 3:19])
    assert not cpu_gemv.takes(x.float(), w.float())  # float32: torch's paths
    assert not cpu_gemv.takes(x, w.half())  # dtypes differ
    stored_transposed = w.t().contiguous().t()  # w.T by rows, as split FFNs' down projections lie
    assert cpu_gemv.takes(x, stored_transposed) and cpu_gemv.takes(torch.zeros(4, 16, dtype=torch.bfloat16),
                                                                      stored_transposed)
    assert not cpu_gemv.takes(torch.zeros(5, 16, dtype=torch.bfloat16), stored_transposed)  # (four rows at most)
    assert not cpu_gemv.takes(x, torch.zeros(16, 32, dtype=torch.bfloat16)[::2, ::2])  # neither way contiguous
    assert not cpu_gemv.takes(torch.zeros(17, 16, dtype=torch.bfloat16), w)  # more rows than it takes
    assert not cpu_gemv.takes(torch.zeros(1, 15, dtype=torch.bfloat16), w)  # K differs
    if cpu_gemv.library() is not None:
        with pytest.raises(ValueError, match="refused"):  # the C side's own guard
            cpu_gemv.rows_times_weight(torch.zeros(17, 16, dtype=torch.bfloat16), w)


def test_it_is_used_where_asked_and_built(monkeypatch, caplog):
    x, w = torch.ones(1, 16, dtype=torch.bfloat16), torch.ones(8, 16, dtype=torch.bfloat16)
    monkeypatch.setenv("VRAMSHARD_CPU_GEMV", "off")
    assert not cpu_gemv.wanted() and not cpu_gemv.serves(x, w)
    for mode in ("auto", "on"):  # wherever it builds, beside a GPU or not
        monkeypatch.setenv("VRAMSHARD_CPU_GEMV", mode)
        assert cpu_gemv.wanted()
    assert cpu_gemv.serves(x, w) == (cpu_gemv.library() is not None)
    assert not cpu_gemv.serves(torch.ones(2, 16, dtype=torch.bfloat16), w)  # one row only
    # No compiler: said once in the log, None, and torch's paths (one-token projections keep their candidates).
    monkeypatch.setattr(cpu_gemv, "_library", [])
    monkeypatch.setattr(cpu_gemv, "_failure", [])
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setattr(cpu_gemv.shutil, "which", lambda name: None)
    with caplog.at_level("INFO"):
        assert cpu_gemv.library() is None and cpu_gemv.library() is None
    assert caplog.text.count("the C kernel is not available here (no C compiler") == 1
    assert not cpu_gemv.serves(x, w) and "gemv" not in cpu_linear._candidates(x, w)


def test_a_build_that_fails_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("VRAMSHARD_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_gemv, "SOURCE", tmp_path / "broken.c")
    (tmp_path / "broken.c").write_text("this is not C\n")
    if cpu_gemv._compiler() is None:
        assert not ON_CI, "CI's machine has a C compiler"
        pytest.skip("no C compiler here")
    with pytest.raises(RuntimeError, match="failed"):
        cpu_gemv._load()
    assert not list((tmp_path / "cpu_gemv").glob("*.so"))  # no half-written library left


@needs_kernel
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("rows", [1, 3, 4, 5])
def test_a_few_rows_ffn_and_its_pieces_through_the_kernel(monkeypatch, dtype, tol, rows):
    """Up to FFN_ROWS rows of dense FFN work (a whole FFN, and pieces of a split-ready one whose down lies
    transposed) go through the kernel with the float32 reference's sums; more rows take torch's paths (the matrix
    tiles off: their rows have tests of their own)."""
    monkeypatch.setenv("VRAMSHARD_CPU_GEMV", "on")
    monkeypatch.setenv("VRAMSHARD_CPU_AMX", "off")
    ffn, weights = _ffn(dtype, hidden=64, intermediate=96)
    whole = _whole(ffn, weights)
    h = torch.randn(rows, ffn.hidden).to(dtype)
    called = []
    monkeypatch.setattr(cpu_gemv, "swiglu", lambda *a, _real=cpu_gemv.swiglu: called.append(1) or _real(*a))
    for first, last in ((0, 5), (0, ffn.num_pieces)):
        part = ffn.pieces_of(whole, first, last)  # down: a column slice of the whole down weight
        expected = swiglu(h.float(), part["gate_proj"].float(), part["up_proj"].float(), part["down_proj"].float())
        got = ffn.contribution(part, h)
        assert got.dtype == dtype and got.shape == (rows, ffn.hidden)
        torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol * expected.abs().max().item())
        # each row's sums are the same whatever rows come with it (batched decoding gives single-sequence tokens)
        if 1 < rows <= cpu_gemv.FFN_ROWS:
            torch.testing.assert_close(ffn.contribution(part, h[1:2]), got[1:2], rtol=0, atol=0)
    assert len(called) == {1: 2, 3: 4, 4: 4, 5: 0}[rows]  # (FFN_ROWS is 4 unless VRAMSHARD_CPU_GEMV_ROWS says)


@needs_kernel
def test_one_token_projections_may_choose_the_kernel(monkeypatch):
    monkeypatch.setenv("VRAMSHARD_CPU_GEMV", "on")
    monkeypatch.setattr(cpu_linear, "_choice", {})
    monkeypatch.setattr(cpu_linear, "_trials", {})
    w = torch.randn(96, 64).to(torch.bfloat16)
    x = torch.randn(1, 64).to(torch.bfloat16)
    assert cpu_linear._candidates(x, w) == ("linear", "mv", "gemv")  # no compiled row sums: nothing to compile
    assert cpu_linear.gemv_serves(torch.bfloat16)
    expected = x.float() @ w.float().T
    for _ in range(3 * cpu_linear.TRIALS):  # every candidate's trials, then the choice
        torch.testing.assert_close(cpu_linear.cpu_linear(x, w).float(), expected, rtol=2e-2, atol=2e-2)
    assert len(cpu_linear._choice) == 1
    assert cpu_linear._candidates(torch.randn(4, 64).to(torch.bfloat16), w) == ("linear", "weight_mm")  # one row only
    torch.testing.assert_close(cpu_linear._gemv(x, w, torch.ones(96, dtype=torch.bfloat16)).float(), expected + 1,
                               rtol=2e-2, atol=2e-2)


@needs_kernel
def test_split_and_cpu_ffns_by_the_kernel_match_the_cpu_reference(tiny_model_dir, monkeypatch):
    """bf16 engine: decode steps' CPU parts and whole CPU FFNs run through the kernel, with no packed
    or row-major copies (the prompt's rows take the other paths); the logits are the float32 CPU
    reference's within bf16's rounding, and the plain (kernel off) split engine's. (The matrix tiles off: the
    prompt's rows through them have a test of their own.)"""
    monkeypatch.setenv("VRAMSHARD_CPU_AMX", "off")
    path = tiny_model_dir("llama")
    expected = trace_logits(Engine.load(path, device="cpu", dtype="float32"))
    monkeypatch.setattr(cpu_packed, "MODE", "on")  # packing asked for: one-row parts still skip it
    monkeypatch.setenv("VRAMSHARD_CPU_GEMV", "off")
    reference = Engine.load(path, device="cpu", dtype="bfloat16")
    placement = _split_placement(reference.model, [3, 15])
    plain = trace_logits(Engine.load(path, placement=placement, simulate_gpu=True, max_context=64, dtype="bfloat16"))
    monkeypatch.setenv("VRAMSHARD_CPU_GEMV", "on")
    called = []
    monkeypatch.setattr(cpu_gemv, "swiglu", lambda *a, _real=cpu_gemv.swiglu: called.append(1) or _real(*a))
    split = Engine.load(path, placement=placement, simulate_gpu=True, max_context=64, dtype="bfloat16")
    got = trace_logits(split)
    decode_steps = len(got) - len(PROMPT)
    # Both layers' CPU parts each decode step, and their GPU parts (a simulated GPU computes them on the CPU)
    assert len(called) == 4 * decode_steps
    scale = expected.abs().max().item()
    torch.testing.assert_close(got.float(), expected, rtol=0, atol=0.06 * scale)
    torch.testing.assert_close(got[len(PROMPT):].float(), plain[len(PROMPT):].float(), rtol=0, atol=0.03 * scale)
    assert split.executor._down_copies.nbytes == 0
    assert {key for key in split.executor._packed._parts} == {("ffn[0]", 3), ("ffn[1]", 15)}  # the prompt's


@needs_kernel
@pytest.mark.parametrize("isa", ["native", "avx2", "plain"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_build_attends_one_token_over_a_paged_caches_rows(isa, dtype):
    """One new token's attention over a sequence's cached rows [L, Hkv, D] viewed by head (as attend hands them
    over): query head h reads key/value head h // (H / Hkv); the float64 softmax's result to the dtype's
    rounding, at one position and at runs long enough to split over threads, for head groups of 1 to 12."""
    lib = _build(isa)
    g = torch.Generator().manual_seed(0)
    for heads, kv_heads, dim, length in ((32, 8, 128, 1), (32, 8, 128, 300), (28, 4, 128, 777), (6, 3, 37, 130),
                                         (4, 4, 8, 3), (48, 4, 64, 65), (40, 8, 16, 200)):
        pool = (3 * torch.randn(length + 5, kv_heads, dim, generator=g)).to(dtype)
        pool_v = torch.randn(length + 5, kv_heads, dim, generator=g).to(dtype)
        keys, values = pool[2:2 + length].transpose(0, 1), pool_v[2:2 + length].transpose(0, 1)  # [Hkv, L, D]
        q = torch.randn(heads, dim, generator=g).to(dtype)
        assert cpu_gemv.serves_attention(q, keys, values)
        out = cpu_gemv.decode_attention(q, keys, values, dim ** -0.5, lib=lib)
        group = heads // kv_heads
        k, v = keys.double().repeat_interleave(group, 0), values.double().repeat_interleave(group, 0)
        weights = torch.softmax((q.double()[:, None, :] * k).sum(-1) * dim ** -0.5, -1)  # [H, L]
        expected = (weights[:, :, None] * v).sum(1)
        assert out.dtype == dtype and out.shape == (heads, dim)
        torch.testing.assert_close(out.double(), expected, rtol=0, atol=8e-3 * expected.abs().max().item())


@needs_kernel
def test_one_sequences_decode_attention_takes_the_kernel_and_others_sdpa(monkeypatch):
    """attention.decode_attention: one sequence on the CPU in half precision through the kernel (SDPA's
    result within the dtype's rounding); a batch with its padding mask, float32, or the kernel off: SDPA."""
    from vramshard.layers.attention import decode_attention

    g = torch.Generator().manual_seed(1)
    pool = torch.randn(50, 4, 32, generator=g).to(torch.bfloat16)
    keys, values = pool[:40].transpose(0, 1)[None], pool[5:45].transpose(0, 1)[None]  # [1, Hkv, L, D]
    q = torch.randn(1, 8, 32, generator=g).to(torch.bfloat16)
    called = []
    monkeypatch.setattr(cpu_gemv, "decode_attention", lambda *a, _real=cpu_gemv.decode_attention: called.append(1) or _real(*a))
    got = decode_attention(q, keys, values, 32 ** -0.5)
    assert called == [1]
    monkeypatch.setenv("VRAMSHARD_CPU_GEMV", "off")
    expected = decode_attention(q, keys, values, 32 ** -0.5)
    assert called == [1]
    torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=2e-2 * expected.abs().max().item())
    monkeypatch.setenv("VRAMSHARD_CPU_GEMV", "auto")
    decode_attention(q.float(), keys.float(), values.float(), 32 ** -0.5)
    decode_attention(q.expand(2, -1, -1), keys.expand(2, -1, -1, -1), values.expand(2, -1, -1, -1), 32 ** -0.5,
                     torch.zeros(2, 1, 1, 40))
    assert called == [1]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tables", [[[0, 1, 2], [5], [7, 8, 9]], [[0, 1, 2], [5], [7, 4, 9]]],
                         ids=["consecutive", "one-out-of-order"])
def test_a_decode_batch_on_the_cpu_attends_sequence_by_sequence_by_the_kernel(monkeypatch, dtype, tables):
    """Several sequences' one new token each on the CPU (attention.attend): by the C kernel over each sequence's
    own rows, in one call where every sequence's blocks are consecutive, else sequence by sequence (a sequence
    whose table is out of order over a copy of its blocks); the same as float32 attention over the same cache
    within the dtype's rounding, and as the padded batch (the kernel off). Keys and values stored alike."""
    from vramshard.layers.attention import attend
    from vramshard.layers.step import Step
    from vramshard.runtime.kv_cache import KVCache

    g = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, size = 8, 2, 32, 16
    cache = KVCache([0], slots=3, max_ctx=64, kv_heads=kv_heads, head_dim=dim, dtype=dtype,
                    device_of=lambda layer: "cpu")
    layer = cache(0)
    layer.k.copy_(torch.randn(layer.k.shape, generator=g))
    layer.v.copy_(torch.randn(layer.v.shape, generator=g))
    q = torch.randn(3, heads, dim, generator=g).to(dtype)
    k = torch.randn(3, kv_heads, dim, generator=g).to(dtype)
    v = torch.randn(3, kv_heads, dim, generator=g).to(dtype)
    starts = [40, 7, 33]
    consecutive = tables[2] == [7, 8, 9]

    def run(kernel: str):
        monkeypatch.setenv("VRAMSHARD_CPU_GEMV", kernel)
        pool = copy.deepcopy(cache)
        step = Step([0, 1, 2], starts, [1, 1, 1], None, kv_lookup=pool, block_tables=tables)
        return attend(q, k, v, pool(0), step), pool(0)

    called = []
    monkeypatch.setattr(cpu_gemv, "decode_attention",
                        lambda *a, _real=cpu_gemv.decode_attention: called.append("one") or _real(*a))
    monkeypatch.setattr(cpu_gemv, "decode_attention_rows",
                        lambda *a, _real=cpu_gemv.decode_attention_rows: called.append("rows") or _real(*a))
    got, got_pool = run("auto")
    assert called == (["rows"] if consecutive else ["one"] * 3)
    batch, batch_pool = run("off")
    assert len(called) in (1, 3) and torch.equal(got_pool.k, batch_pool.k) and torch.equal(got_pool.v, batch_pool.v)
    flat_k, flat_v = got_pool.k.float().flatten(0, 1), got_pool.v.float().flatten(0, 1)
    for b, (table, start) in enumerate(zip(tables, starts)):
        rows = torch.tensor([table[p // size] * size + p % size for p in range(start + 1)])
        keys = flat_k[rows].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)  # [H, L, D]
        values = flat_v[rows].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        weights = torch.softmax((keys @ q[b].float()[:, :, None])[..., 0] * dim ** -0.5, dim=-1)  # [H, L]
        expected = (weights[:, None, :] @ values)[:, 0]  # [H, D]
        tolerance = 2e-2 * expected.abs().max().item()
        torch.testing.assert_close(got[b].float(), expected, rtol=0, atol=tolerance)
        torch.testing.assert_close(batch[b].float(), expected, rtol=0, atol=tolerance)


@needs_kernel
def test_the_rows_kernel_splits_sequences_into_runs_and_matches_one_call_per_sequence():
    """cpu_gemv.decode_attention_rows with more threads than sequences: each sequence split into runs of positions
    (a one-position sequence's second run empty), combined; each sequence as decode_attention computes it alone
    (within rounding); rows outside the pool refused."""
    g = torch.Generator().manual_seed(5)
    pool_k = torch.randn(400, 2, 32, generator=g).to(torch.bfloat16)
    pool_v = torch.randn(400, 2, 32, generator=g).to(torch.bfloat16)
    q = torch.randn(3, 8, 32, generator=g).to(torch.bfloat16)
    starts, lengths = torch.tensor([10, 320, 399]), torch.tensor([300, 70, 1])
    threads = torch.get_num_threads()
    torch.set_num_threads(6)  # two runs a sequence
    try:
        got = cpu_gemv.decode_attention_rows(q, pool_k, pool_v, starts, lengths, 32 ** -0.5)
    finally:
        torch.set_num_threads(threads)
    for b in range(3):
        rows = slice(int(starts[b]), int(starts[b] + lengths[b]))
        alone = cpu_gemv.decode_attention(q[b], pool_k[rows].transpose(0, 1), pool_v[rows].transpose(0, 1), 32 ** -0.5)
        torch.testing.assert_close(got[b].float(), alone.float(), rtol=0, atol=1e-2 * alone.abs().max().item())
    with pytest.raises(ValueError, match="inside the pool"):
        cpu_gemv.decode_attention_rows(q, pool_k, pool_v, starts, torch.tensor([300, 70, 2]), 32 ** -0.5)


@needs_kernel
def test_the_word_wait_returns_when_the_word_arrives_or_at_its_time_with_the_gil_free():
    """The run-ahead worker's wait for the GPU's ready word (cpu_gemv.wait_for_word): it returns the
    word's value once it reaches the number (written here by a timer thread, which needs the GIL to
    run: the wait leaves it free), and after its time where it never does."""
    import threading
    import time

    word = torch.zeros(1, dtype=torch.int64)
    view = word.numpy()
    threading.Timer(0.05, lambda: view.__setitem__(0, 3)).start()
    began = time.perf_counter()
    assert cpu_gemv.wait_for_word(word, 2, 5.0) == 3
    assert 0.04 < time.perf_counter() - began < 2.0
    began = time.perf_counter()
    assert cpu_gemv.wait_for_word(word, 4, 0.05) == 3  # never raised: back after its time
    assert 0.04 < time.perf_counter() - began < 1.0
    assert cpu_gemv.wait_for_word(word, 3, 0.0) == 3  # already there
    with pytest.raises(ValueError, match="CPU int64 tensor"):
        cpu_gemv.wait_for_word(torch.zeros(1, dtype=torch.int32), 1, 0.01)


@needs_kernel
def test_a_bound_experts_part_waits_for_its_word_computes_and_raises_its_ticket():
    """The run-ahead worker's host-expert part as one C call (cpu_gemv.bind_routed_experts_part), bound while
    its inputs are still to be written (as a copy from the GPU writes them): before the ready word reaches its
    number it computes nothing and leaves the ticket; once it has, it reads the inputs as they are then, writes
    what routed_experts computes into the buffer and raises the ticket, the GIL free meanwhile; an expert index
    outside the layer is refused with the ticket raised all the same (the GPU goes on)."""
    import threading

    g = torch.Generator().manual_seed(2)
    E, width, hidden, k, tokens = 6, 24, 40, 3, 2
    gate_up = torch.randn(E, 2 * width, hidden, generator=g).to(torch.bfloat16)
    down = torch.randn(E, hidden, width, generator=g).to(torch.bfloat16)
    x, experts = torch.zeros(tokens, hidden, dtype=torch.bfloat16), torch.zeros(tokens, k, dtype=torch.int64)
    weights, out = torch.zeros(tokens, k), torch.full((tokens, hidden), 7.0, dtype=torch.bfloat16)
    part = cpu_gemv.bind_routed_experts_part(x, gate_up, down, experts, weights, out)
    assert part is not None
    ready, ticket = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    status, waited = part.run(ready, ticket, 1, 0.02, 2)
    assert status == part.NOT_READY and waited >= 0.015 and ticket.item() == 0 and (out == 7).all()

    values = (torch.randn(tokens, hidden, generator=g).to(torch.bfloat16),
              torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)]), torch.rand(tokens, k, generator=g))

    def land():  # the inputs' copy, then the ready word (as the GPU's stream orders them)
        for tensor, value in zip((x, experts, weights), values):
            tensor.copy_(value)
        ready.numpy()[0] = 1

    threading.Timer(0.05, land).start()  # (runs while the call waits: the GIL is free)
    status, waited = part.run(ready, ticket, 1, 5.0, 2)
    assert status == 0 and 0.04 < waited < 2.0 and ticket.item() == 1
    torch.testing.assert_close(out, cpu_gemv.routed_experts(*values[:1], gate_up, down, *values[1:]), rtol=0, atol=0)

    experts[0, 0] = E  # outside the layer
    ready.numpy()[0] = 2
    with pytest.raises(ValueError, match="refused the routed experts"):
        part.run(ready, ticket, 2, 1.0, 1)
    assert ticket.item() == 2
    assert cpu_gemv.bind_routed_experts_part(x, gate_up, down, experts, weights, out.float()) is None  # out's dtype
    assert cpu_gemv.bind_routed_experts_part(x.float(), gate_up, down, experts, weights, out) is None  # the kernel's


@needs_kernel
def test_a_bound_swiglu_part_waits_for_its_word_computes_and_raises_its_ticket(monkeypatch):
    """A split dense FFN's CPU part as one C call for the run-ahead worker (DenseFFN.contribution_part): bound
    while its input is still to be written, it computes nothing before the ready word reaches its number; then
    writes what contribution computes (down stored transposed, as split FFNs keep it) and raises the ticket.
    Tensors the kernel does not take give no part (the worker runs the Python job)."""
    import threading

    dtype = torch.bfloat16
    ffn, weights = _ffn(dtype, hidden=64, intermediate=96)
    whole = _whole(ffn, weights)
    part_weights = ffn.pieces_of(whole, 0, 5)
    h = torch.zeros(2, ffn.hidden, dtype=dtype)
    out = torch.full((2, ffn.hidden), 7.0, dtype=dtype)
    part = ffn.contribution_part(part_weights, h, out)
    assert part is not None
    ready, ticket = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    status, waited = part.run(ready, ticket, 1, 0.02, 2)
    assert status == part.NOT_READY and waited >= 0.015 and ticket.item() == 0 and (out == 7).all()
    value = torch.randn(2, ffn.hidden, generator=torch.Generator().manual_seed(3)).to(dtype)

    def land():  # the input's copy, then the ready word
        h.copy_(value)
        ready.numpy()[0] = 1

    threading.Timer(0.05, land).start()  # (runs while the call waits: the GIL is free)
    status, waited = part.run(ready, ticket, 1, 5.0, torch.get_num_threads())  # (contribution's team: its sums)
    assert status == 0 and 0.04 < waited < 2.0 and ticket.item() == 1
    torch.testing.assert_close(out, ffn.contribution(part_weights, value), rtol=0, atol=0)
    expected = _swiglu_reference(value, part_weights["gate_proj"], part_weights["up_proj"], part_weights["down_proj"])
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-2 * expected.abs().max().item())
    assert ffn.contribution_part(part_weights, h, out.float()) is None  # out's dtype
    assert ffn.contribution_part(part_weights, h.float(), out) is None  # the kernel's dtypes
    rows = lambda n: (torch.zeros(n, ffn.hidden, dtype=dtype), torch.zeros(n, ffn.hidden, dtype=dtype))  # noqa: E731
    monkeypatch.setenv("VRAMSHARD_CPU_AMX", "off")
    assert ffn.contribution_part(part_weights, *rows(5)) is None  # past the one-row kernel's rows
    monkeypatch.setenv("VRAMSHARD_CPU_AMX", "on")
    assert (ffn.contribution_part(part_weights, *rows(5)) is not None) is cpu_gemv.tiles_here()  # the tiles' rows
    assert ffn.contribution_part(part_weights, *rows(cpu_gemv.AMX_ROWS + 1)) is None  # past theirs


needs_tiles = pytest.mark.skipif(cpu_gemv.library() is None or not cpu_gemv.tiles_here(),
                                 reason="no CPU matrix tiles (AMX) here")


@needs_tiles
def test_the_matrix_tiles_compute_the_rows_times_the_weight():
    """vs_amx_rows_times_weight: 1 to 64 rows of bf16 x against weights by rows (whole, a column slice), with
    N % 16 rows and K % 32 columns past the tiles' blocks, as float64 does; each row's sums whatever rows come
    with it; what it refuses, refused."""
    g = torch.Generator().manual_seed(7)
    for n, k in ((37, 4101), (64, 96), (16, 32), (5, 7)):
        wide = torch.randn(n, k + 13, generator=g).to(torch.bfloat16)
        for w in (wide[:, :k].contiguous(), wide[:, 5:5 + k]):
            for rows in (1, 5, 16, 17, 33, 64):
                x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
                y = cpu_gemv.amx_rows_times_weight(x, w)
                expected = x.double() @ w.double().T
                assert y.shape == (rows, n)
                torch.testing.assert_close(y.double(), expected, rtol=0, atol=2e-5 * expected.abs().max().item() + 1e-6)
                assert torch.equal(cpu_gemv.amx_rows_times_weight(x[-1:], w), y[-1:])
    with pytest.raises(ValueError, match="through the matrix tiles"):
        cpu_gemv.amx_rows_times_weight(torch.randn(65, 32).to(torch.bfloat16), torch.randn(16, 32).to(torch.bfloat16))
    with pytest.raises(ValueError, match="through the matrix tiles"):
        cpu_gemv.amx_rows_times_weight(torch.randn(4, 32).half(), torch.randn(16, 32).half())


@needs_tiles
@pytest.mark.parametrize("mode,gpu", [("on", True), ("off", False), ("auto", False), ("auto", True)])
def test_a_few_dozen_rows_of_ffn_work_take_the_matrix_tiles_where_asked(monkeypatch, mode, gpu):
    """VRAMSHARD_CPU_AMX=on, or auto (the default) in a process without a GPU: bf16 FFN work of 5 to 64 rows from
    weights by rows (a split FFN's part with its down row-major, a whole FFN) goes through the C kernel's tiles, as
    float64 does with the activation rounded once; a down stored transposed, fp16 and 65 rows keep torch's paths;
    off, or auto beside a GPU: none of it."""
    monkeypatch.setenv("VRAMSHARD_CPU_AMX", mode)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    tiles = mode == "on" or mode == "auto" and not gpu
    assert cpu_gemv.amx() is tiles
    g = torch.Generator().manual_seed(8)
    hidden, width = 70, 40
    gate, up = (torch.randn(width, hidden, generator=g) * 0.2).to(torch.bfloat16), \
        (torch.randn(width, hidden, generator=g) * 0.2).to(torch.bfloat16)
    down = (torch.randn(hidden, width + 6, generator=g) * 0.2).to(torch.bfloat16)[:, 3:3 + width]
    for rows in (5, 16, 64):
        h = torch.randn(rows, hidden, generator=g).to(torch.bfloat16)
        assert cpu_gemv.serves_swiglu(h, gate, up, down) is tiles
        assert not cpu_gemv.serves_swiglu(h, gate, up, down.t().contiguous().t())  # stored transposed
        assert not cpu_gemv.serves_swiglu(h.half(), gate.half(), up.half(), down.half())
        if tiles:
            expected = _swiglu_reference(h, gate, up, down)
            torch.testing.assert_close(swiglu(h, gate, up, down).double(), expected, rtol=0,
                                       atol=1e-2 * expected.abs().max().item())
    assert not cpu_gemv.serves_swiglu(torch.randn(65, hidden).to(torch.bfloat16), gate, up, down)


@needs_tiles
def test_split_ffns_of_a_few_dozen_rows_by_the_tiles_match_the_cpu_reference(tiny_model_dir, monkeypatch):
    """bf16 split engine with VRAMSHARD_CPU_AMX=on: the prompt's rows (more than the one-row kernel's) go through
    the tiles, their parts from the row-major copy of down (none prepacked); the logits are the float32 CPU
    reference's within bf16's rounding."""
    path = tiny_model_dir("llama")
    expected = trace_logits(Engine.load(path, device="cpu", dtype="float32"))
    monkeypatch.setattr(cpu_packed, "MODE", "on")  # packing asked for: the tiles' rows skip it
    monkeypatch.setenv("VRAMSHARD_CPU_AMX", "on")
    reference = Engine.load(path, device="cpu", dtype="bfloat16")
    placement = _split_placement(reference.model, [3, 15])
    rows = []
    monkeypatch.setattr(cpu_gemv, "swiglu", lambda h, *a, _real=cpu_gemv.swiglu: rows.append(h.shape[0]) or _real(h, *a))
    split = Engine.load(path, placement=placement, simulate_gpu=True, max_context=64, dtype="bfloat16")
    got = trace_logits(split)
    assert len(PROMPT) > cpu_gemv.FFN_ROWS and len(PROMPT) in rows
    torch.testing.assert_close(got.float(), expected, rtol=0, atol=0.06 * expected.abs().max().item())
    assert not split.executor._packed._parts
