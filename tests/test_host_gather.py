"""The host's gather of KV-cache blocks (GPU attention over a host KV cache, and a CPU decode batch):
measured by the profile (``cpu.gather_gb_s``), read back with its fallbacks, and priced by the estimator
at that rate (session 63: a constant 10 GB/s priced an H100 host's GPU-only 64-sequence step at 935 ms
against 428-443 measured)."""

import pytest

from vramshard.errors import ProfileError
from vramshard.plan.estimator import Estimator
from vramshard.plan.memory import sublayer_triples
from vramshard.plan.placement import named_placement
from vramshard.profile.bench_memory import measure_cpu_gather, measure_cpu_read
from vramshard.profile.query import DEFAULT_GATHER_BPS, GATHER_READ_SHARE, Profile
from vramshard.profile.synthetic import synthetic_data
from vramshard.shapes import shape_model

GPU = dict(cpu_gflops=1500, gpu_gflops=200_000, h2d_gbps=50, cpu_mem_gbps=80, gpu_mem_gbps=1500)
MODEL = shape_model("llama3-8b")


def with_cpu(**figures) -> Profile:
    data = synthetic_data(**GPU)
    data["cpu"].update(figures)
    return Profile(data)


def test_the_gather_is_priced_as_measured_else_at_half_the_read_else_at_the_default():
    nbytes = 300 * 2**20
    assert with_cpu(gather_gb_s=40.0, read_gb_s=100.0).host_gather_s(nbytes) == pytest.approx(nbytes / 40e9)
    assert with_cpu(read_gb_s=100.0).host_gather_s(nbytes) == pytest.approx(nbytes / (100e9 * GATHER_READ_SHARE))
    assert with_cpu().host_gather_s(nbytes) == pytest.approx(nbytes / DEFAULT_GATHER_BPS)
    # Memory-bound host work: slower where the engine found the host's CPU slower.
    slow = with_cpu(gather_gb_s=40.0).calibrated(cpu_scale=1.5)
    assert slow.host_gather_s(nbytes) == pytest.approx(1.5 * nbytes / 40e9)
    assert with_cpu(gather_gb_s=40.0).summary()["cpu_gather_gb_s"] == 40.0
    assert with_cpu().summary()["cpu_gather_gb_s"] is None


@pytest.mark.parametrize("bad", [-1, 0, float("nan"), "fast"])
def test_a_bad_gather_figure_is_refused_clearly(bad):
    data = synthetic_data(**GPU)
    data["cpu"]["gather_gb_s"] = bad
    with pytest.raises(ProfileError, match="gather_gb_s"):
        Profile(data)


def test_a_step_over_a_host_kv_cache_spends_the_gather_on_the_host(monkeypatch):
    """64 sequences at 1K context each, every attention streamed over a host KV cache the copy engine cannot read in
    place: the host gathers each layer's 285 MB of cached keys and values into a pinned buffer before its copy in.
    At 10 GB/s the gathers set the step. With one pinned buffer each gather waits for the copy before it, so gathers
    and copies add up; with two (the executor's KV_IN_BUFFERS) the host gathers the next layer while the copy engine
    reads this one, and at 50 GB/s the step is the copy engine's (it streams the weights too)."""
    import vramshard.plan.estimator as estimator_module

    monkeypatch.setattr(estimator_module, "DIRECT_RUN_BLOCKS", 10**9)  # (no run long enough to copy in place)
    rows, context = 64, 64 * 1088
    placement = named_placement("stream-hostkv", sublayer_triples(MODEL), MODEL.args.num_hidden_layers)
    attention = [s for s in MODEL if s.kind == "attn"]
    cached = sum(Estimator(MODEL, with_cpu()).staging_bytes(a, rows, context)[0] for a in attention)

    def step(rate: float, buffers: int):
        monkeypatch.setattr(estimator_module, "KV_IN_BUFFERS", buffers)
        return Estimator(MODEL, with_cpu(gather_gb_s=rate)).simulate(placement, rows, context)

    assert step(10.0, 2).seconds >= cached / 10e9
    one, two = step(30.0, 1), step(30.0, 2)
    profile = with_cpu()
    copies_in = sum(profile.transfer_s(Estimator(MODEL, profile).staging_bytes(a, rows, context)[0], "h2d")
                    for a in attention)
    assert copies_in > 0.1 and one.seconds >= cached / 30e9 + copies_in
    assert two.seconds < 0.95 * one.seconds
    fast = step(50.0, 2)
    assert fast.seconds == pytest.approx(fast.copy_busy, rel=0.05)


def test_a_page_locked_host_cache_is_copied_in_place_and_the_host_only_issues_the_copies():
    """Beside a GPU the executor page-locks a staged KV cache and the copy engine reads each sequence's run of
    blocks in place (KVStaging._copy_in_place): the host issues two copies a sequence and scatters the new rows, so
    even at a slow gather the 64-sequence 1K-context step is the copy engine's; sequences of a few hundred positions
    (shorter than DIRECT_RUN_BLOCKS blocks each) are gathered as before."""
    from vramshard.runtime.kv_staging import DIRECT_RUN_BLOCKS

    rows = 64
    placement = named_placement("stream-hostkv", sublayer_triples(MODEL), MODEL.args.num_hidden_layers)
    slow_gather = Estimator(MODEL, with_cpu(gather_gb_s=5.0))
    long = slow_gather.simulate(placement, rows, rows * 1088)
    assert long.seconds == pytest.approx(long.copy_busy, rel=0.05)
    attention = [s for s in MODEL if s.kind == "attn"]
    short_context = rows * (DIRECT_RUN_BLOCKS * 16 - 16)  # one block short of a run worth copying in place
    short = slow_gather.simulate(placement, rows, short_context)
    gathered = sum(slow_gather.staging_bytes(a, rows, short_context)[0] for a in attention)
    assert short.seconds >= gathered / 5e9


def test_a_cpu_decode_batch_gathers_at_the_profiles_rate_without_the_kernel():
    attention = next(s for s in MODEL if s.kind == "attn")
    extra = {}
    for rate in (10.0, 40.0):
        estimator = Estimator(MODEL, with_cpu(gather_gb_s=rate), cpu_gemv=False)
        extra[rate] = estimator.compute_s(attention, "cpu", 16, 4096) - estimator.compute_s(attention, "cpu", 1, 4096)
    per_token = attention.kv_bytes_per_token(MODEL.dtype)
    # (16 rows of attention's matmuls cost a little more than one: the difference is the gather, within that)
    assert extra[10.0] - extra[40.0] == pytest.approx(4096 * per_token * (1 / 10e9 - 1 / 40e9), rel=0.05)


def test_with_the_kernel_a_cpu_decode_batch_attends_sequence_by_sequence_without_a_gather():
    """The C kernel takes each sequence's one token over its own rows in place (attention.attend, session 63): the
    tier's attention is its sequences' one-token attentions over their shares of the context, no gather."""
    attention = next(s for s in MODEL if s.kind == "attn")
    heads = (attention.num_heads, attention.num_kv_heads, attention.head_dim)
    profile = with_cpu(gather_gb_s=10.0)
    kernel = Estimator(MODEL, profile, cpu_gemv=True)
    one_each = 16 * profile.attention_s(1, 4096 // 16, *heads, MODEL.dtype, "cpu")
    assert kernel.attention_s(attention, "cpu", 16, 4096) == pytest.approx(one_each)
    padded = Estimator(MODEL, profile, cpu_gemv=False).attention_s(attention, "cpu", 16, 4096)
    assert padded > one_each + profile.host_gather_s(4096 * attention.kv_bytes_per_token(MODEL.dtype))
    # One token, a prompt chunk and the GPU take the profile's attention as measured.
    for tokens, device in ((1, "cpu"), (512, "cpu"), (16, "cuda")):
        assert kernel.attention_s(attention, device, tokens, 4096) == pytest.approx(
            profile.attention_s(tokens, 4096, *heads, MODEL.dtype, device))


def test_the_gather_timing_is_real():
    """Not faked: a gather of a few MiB on this host arrives at a rate between a tenth of the host's read and
    the read itself plus noise (it reads and writes each byte; 13 against 30 GB/s on the development machine)."""
    read = measure_cpu_read(0.05, nbytes=64 * 2**20)
    gather = measure_cpu_gather(0.05, nbytes=64 * 2**20)
    assert 0.05 * read < gather < 2.0 * read
