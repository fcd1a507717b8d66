"""The CPU's pass over a MoE layer's host experts as the run-ahead worker computes it: the profile
times it on a worker thread beside Python (``host_experts_worker``), and the estimator prices the
worker's experts with that rate (the CPU's share of the zero-copy experts, ``experts-cpu`` steps)."""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path

import pytest
import torch

from vramshard.errors import ProfileError
from vramshard.layers import host_experts
from vramshard.layers.moe import MoEFFN
from vramshard.plan.estimator import Estimator, host_pass_s
from vramshard.plan.memory import moe_layers, sublayer_triples
from vramshard.plan.placement import named_placement
from vramshard.profile import load
from vramshard.profile.bench_experts import measure_host_experts, team_candidates
from vramshard.profile.progress import ProgressSink
from vramshard.profile.query import Profile, fastest_team
from vramshard.profile.timing import time_cpu_beside_python
from vramshard.runtime import run_ahead
from vramshard.shapes import shape_model

from kernel_helpers import needs_kernel

RUN15 = Path(__file__).resolve().parents[1] / "docs" / "profiles" / "h200-run15.json"  # it timed the pass alone
QWEN30 = shape_model("qwen3-30b-a3b")


@pytest.fixture(scope="module")
def run15() -> Profile:
    return load(RUN15, check_fingerprint=False)


def with_worker_rates(profile: Profile, slower: float, beside: str | None = "launches") -> Profile:
    """``profile`` whose pass on the worker runs ``slower`` times its time alone, timed ``beside`` a
    host thread of that kind (None: before session 39, beside Python alone)."""
    data = copy.deepcopy(profile.data)
    data["host_experts_worker"] = {dtype: {rows: rate / slower for rows, rate in by_rows.items()}
                                   for dtype, by_rows in data["host_experts"].items()}
    if beside is not None:
        data["host_experts_worker_beside"] = beside
    return Profile(data)


def test_the_worker_rate_is_read_where_measured_and_the_rate_alone_elsewhere(run15):
    slow = with_worker_rates(run15, 2.0)
    alone = run15.host_experts_rate("bf16", 1)
    assert slow.host_experts_rate("bf16", 1) == pytest.approx(alone)
    assert slow.host_experts_rate("bf16", 1, on_worker=True) == pytest.approx(alone / 2)
    assert run15.host_experts_rate("bf16", 1, on_worker=True) == pytest.approx(alone)  # (not measured: alone)
    assert slow.calibrated(1.5).host_experts_rate("bf16", 1, on_worker=True) == pytest.approx(alone / 3)
    # Timed beside Python alone (profiles before session 39): 3.7x too slow on the H100 machine, not used.
    old = with_worker_rates(run15, 2.0, beside=None)
    assert not old.worker_rates_measured and slow.worker_rates_measured
    assert old.host_experts_rate("bf16", 1, on_worker=True) == pytest.approx(alone)


def test_a_bad_worker_section_is_refused_by_name(run15):
    data = copy.deepcopy(run15.data)
    data["host_experts_worker"] = {"bf16": {"1": -5.0}}
    with pytest.raises(ProfileError, match="run-ahead worker for bf16 at 1 rows"):
        Profile(data)


def test_the_estimator_prices_the_workers_experts_at_the_worker_rate(run15):
    """With run-ahead, the CPU's share of the zero-copy experts and experts-cpu's host experts are
    the worker's: a slower worker rate slows those steps; without run-ahead the host thread computes
    them and the worker rate does not count."""
    slow = with_worker_rates(run15, 2.5)
    placement = named_placement("experts-cpu", sublayer_triples(QWEN30), QWEN30.args.num_hidden_layers,
                                moe_layers=moe_layers(QWEN30))

    def step(profile: Profile, **options) -> float:
        return Estimator(QWEN30, profile, **options).simulate(placement, 1, 1024).seconds

    shared = dict(zero_copy=True, zero_copy_cpu_share=0.5)
    assert step(slow, run_ahead=True, **shared) > 1.3 * step(run15, run_ahead=True, **shared)
    assert step(slow, run_ahead=False, **shared) == pytest.approx(step(run15, run_ahead=False, **shared))
    assert step(slow, run_ahead=True, zero_copy=False) > 1.3 * step(run15, run_ahead=True, zero_copy=False)
    assert step(slow, run_ahead=True, zero_copy=True) == pytest.approx(step(run15, run_ahead=True, zero_copy=True))


def test_time_cpu_beside_python_runs_the_work_on_a_worker_of_that_many_threads():
    seen = []

    def work():
        seen.append((threading.current_thread() is threading.main_thread(), torch.get_num_threads(),
                     torch.is_inference_mode_enabled()))
        sum(range(1000))

    before = torch.get_num_threads()
    seconds = time_cpu_beside_python(work, 0.01, threads=1, switch_interval_s=1e-4)
    assert seconds > 0 and len(seen) >= 3  # the untimed first call, time_cpu's warm-up, the timed runs
    assert set(seen) == {(False, 1, True)}
    assert torch.get_num_threads() == before

    def broken():
        raise ValueError("no such expert")

    with pytest.raises(ValueError, match="no such expert"):
        time_cpu_beside_python(broken, 0.01, threads=1, switch_interval_s=1e-4)


def test_beside_the_profiles_host_thread_the_worker_takes_the_gil_back_between_its_launches():
    """The profile's host thread gives the GIL up in a torch call every few microseconds, as the
    executor's does between its launches: a part that gives it up five times (as torch calls do)
    then waits far less than the switch interval for each take. Beside Python alone, each take
    waited for the switch interval (2.27 ms against 0.61 alone for the H100 host's expert pass)."""
    def part():
        for _ in range(5):
            time.sleep(0)  # gives the GIL up and takes it back

    seconds = time_cpu_beside_python(part, 0.2, threads=1, switch_interval_s=0.05)
    assert seconds < 0.05  # beside Python alone: about 5 x 50 ms


def test_the_profile_times_the_pass_alone_and_on_the_worker():
    """measure_host_experts: the rate alone, and on the worker where asked (a GPU machine's profile);
    both of the pass's bytes over a time that can only be positive."""
    if not host_experts.ENABLED:
        pytest.skip("the compiled pass is off here")
    measured = measure_host_experts("bf16", 256, 128, 2, [1], budget_s=0.02, progress=ProgressSink(),
                                    weight=1.0, on_worker=True)
    if measured is None:
        pytest.skip("the compiled pass does not run here (no C++ compiler)")
    assert set(measured.alone) == set(measured.worker) == {"1"}
    assert measured.alone["1"] > 0 and measured.worker["1"] > 0
    # Every candidate team timed; the rows table holds the chosen team's one-token rate.
    teams = team_candidates(run_ahead.largest_team(torch.get_num_threads()))
    assert sorted(map(int, measured.teams)) == sorted(teams)
    assert measured.worker["1"] == measured.teams[str(fastest_team(measured.teams))]
    alone_only = measure_host_experts("bf16", 256, 128, 2, [1], budget_s=0.02, progress=ProgressSink(),
                                      weight=1.0)
    assert alone_only is not None and alone_only.worker == {} and alone_only.teams == {}


def test_the_profile_times_the_pass_over_its_whole_budget(monkeypatch):
    """A point's timed calls are bounded by its budget, not by time_cpu's default of 50 (which timed the
    one-token pass over ~20 ms of its 0.3 s on the H100 host)."""
    from vramshard.profile import bench_experts, timing

    if not host_experts.ENABLED:
        pytest.skip("the compiled pass is off here")
    calls = []
    real = timing.time_cpu

    def counting(fn, budget_s, max_reps=50, min_reps=2):
        calls.append(max_reps)
        return real(fn, budget_s, max_reps, min_reps)

    monkeypatch.setattr(bench_experts, "time_cpu", counting)
    monkeypatch.setattr(timing, "time_cpu", counting)  # (the worker's timing calls it there)
    measured = measure_host_experts("bf16", 256, 128, 2, [1], budget_s=0.02, progress=ProgressSink(),
                                    weight=1.0, on_worker=True)
    if measured is None:
        pytest.skip("the compiled pass does not run here (no C++ compiler)")
    assert calls and all(reps == bench_experts.PASS_REPS >= 1000 for reps in calls)


def test_the_pass_on_fewer_threads_is_priced_slower(run15):
    """The profile times the expert pass on all cores; on fewer threads it is priced as a projection
    of the experts' shape is (it was priced the same on one thread as on sixteen)."""
    moe = QWEN30["ffn[0]"]
    all_cores = Estimator(QWEN30, run15).experts_s(moe, "cpu", 1)
    assert Estimator(QWEN30, run15, threads=run15.default_threads).experts_s(moe, "cpu", 1) == pytest.approx(all_cores)
    assert Estimator(QWEN30, run15, threads=1).experts_s(moe, "cpu", 1) > 3 * all_cores
    assert run15.cpu_thread_factor("bf16", None, 1, 2048, 1536) == 1.0


def test_a_tier_computing_host_experts_keeps_every_core(monkeypatch, run15):
    """A MoE tier whose CPU work is its host experts (and the embedding) runs on all cores: the
    thread count the estimator priced equal to all cores won the tie once, one thread, and the
    twenty-fourth GPU session's planned cell decoded at 2.99 tok/s where the kernels alone did 12.55."""
    from vramshard.plan.planner import Planner
    from vramshard.plan.tiers import Tiers
    from vramshard.runtime import run_ahead, zero_copy_experts

    monkeypatch.setattr(zero_copy_experts, "available", lambda: True)
    monkeypatch.setattr(run_ahead, "available", lambda dense=False: True)
    plan = Planner(QWEN30, run15, 8 * 2**30, context=2064, tiers=Tiers((1, 4, 64, 1024))).plan()
    host = [tier for tier, p in plan.tiers.items() if p.placement.expert_names("host")]
    assert 1 in host, "the decode tier no longer computes host experts: this test needs another case"
    assert all(plan.tiers[tier].threads is None for tier in host)


@pytest.mark.parametrize("splits, slower", [(True, 1.5), (False, 1.0)], ids=["any-count", "all-or-none"])
def test_a_worker_slower_than_priced_gets_fewer_experts_once_the_engine_fits_it(monkeypatch, run15, splits, slower):
    """The engine's in-run fit of a tier's CPU work (``calibrate.fit_cpu_rows``, from the worker's
    computing time the executor reports) reaches the share: the plan made again from the fitted
    profile gives the worker fewer of each token's experts, or none; by default (all or none, see
    ``moe_variants.PLANS_SHARES``) none where it had all."""
    from vramshard.plan import calibrate, moe_variants
    from vramshard.plan.planner import Planner
    from vramshard.plan.tiers import Tiers
    from vramshard.runtime import run_ahead, zero_copy_experts

    monkeypatch.setattr(zero_copy_experts, "available", lambda: True)
    monkeypatch.setattr(run_ahead, "available", lambda dense=False: True)
    monkeypatch.setattr(moe_variants, "PLANS_SHARES", splits)
    profile = with_worker_rates(run15, slower)
    top_k = QWEN30["ffn[0]"].top_k

    def plan(p: Profile):
        return Planner(QWEN30, p, 8 * 2**30, context=2064, tiers=Tiers((1, 64))).plan()

    first = plan(profile)
    count = round(first.tiers[1].zero_copy_cpu_share * top_k)
    assert count >= 2 if splits else count == top_k
    predicted = calibrate.cpu_seconds(QWEN30, profile, first, 1)
    fitted = calibrate.fit_cpu_rows(QWEN30, profile, first, {1: 3 * predicted})
    assert fitted is not None and fitted.profile.cpu_row_factor(1) > 2
    again = plan(fitted.profile)
    assert round(again.tiers[1].zero_copy_cpu_share * top_k) < count


def test_a_few_tokens_experts_by_the_c_kernel_are_priced_from_the_kernels_one_row_tables():
    """A profile that timed the compiled pass (before session 35) but its one-row tables through the C
    kernel: a few tokens' experts, which the executor now computes by the kernel, are priced as the
    kernel's one-row products of the distinct experts they route to (alone or on the worker: two GIL
    takes a pass); an executor without the kernel keeps the pass's rate; a profile that timed the
    experts through the kernel keeps its own rate; the engine's fit at a tier's rows applies to it."""
    h100 = load(Path(__file__).resolve().parents[1] / "docs" / "profiles" / "h100-run34.json", check_fingerprint=False)
    assert h100.cpu_gemv and not h100.host_experts_cpu_gemv
    moe = next(s for s in QWEN30 if isinstance(s, MoEFFN))
    by_kernel = moe.top_k * (h100.matmul_s(1, moe.hidden, 2 * moe.intermediate, "bf16", "cpu")
                             + h100.matmul_s(1, moe.intermediate, moe.hidden, "bf16", "cpu"))
    by_rate = moe.top_k * moe.expert_bytes / h100.host_experts_rate("bf16", 1)
    assert host_pass_s(h100, moe, 1, gemv=True) == pytest.approx(by_kernel)
    assert host_pass_s(h100, moe, 1, on_worker=True, gemv=True) == pytest.approx(by_kernel)
    assert host_pass_s(h100, moe, 1, gemv=False) == pytest.approx(by_rate)
    assert by_kernel != pytest.approx(by_rate, rel=0.02)  # (the two ways differ: the check can fail)
    one = by_kernel / moe.top_k
    for rows in (4, 16):  # each distinct expert read once for its tokens
        assert moe.expected_experts_touched(rows) < rows * moe.top_k
        assert host_pass_s(h100, moe, rows, gemv=True) == pytest.approx(moe.expected_experts_touched(rows) * one)
    assert host_pass_s(h100, moe, 16, gemv=True) < 0.9 * host_pass_s(h100, moe, 16, gemv=False)  # (the pass's rate)
    assert host_pass_s(h100, moe, 32, gemv=True) is None  # (more tokens than the pass takes: the tables count)
    tier = h100.calibrated(cpu_rows={1: 1.25, 16: 2.0})
    assert host_pass_s(tier, moe, 16, gemv=True) == pytest.approx(2.0 * host_pass_s(h100, moe, 16, gemv=True))
    timed_by_kernel = Profile({**h100.data, "host_experts_cpu_gemv": h100.cpu_gemv})
    assert host_pass_s(timed_by_kernel, moe, 1, gemv=True) == pytest.approx(by_rate)
    fitted = h100.calibrated(cpu_rows={1: 1.5})  # (the engine's fits apply to it as to every CPU product)
    assert host_pass_s(fitted, moe, 1, gemv=True) == pytest.approx(1.5 * by_kernel)


@needs_kernel
@pytest.mark.parametrize("one_call", [True, False])
def test_on_the_worker_the_profile_times_the_pass_as_the_worker_runs_it(monkeypatch, one_call):
    """With the worker's one C call on (VRAMSHARD_RUN_AHEAD_ONE_CALL), the worker's rates are of that call
    (each run computing a routing's experts, the ticket raised); off, of the layer's own code only."""
    from vramshard.layers import cpu_gemv

    monkeypatch.setattr(run_ahead, "ONE_CALL", one_call)
    runs = []
    real_run = cpu_gemv.BoundPart.run

    def counted(self, ready, ticket, number, seconds, threads):
        status, waited = real_run(self, ready, ticket, number, seconds, threads)
        runs.append((status, int(ticket[0])))
        return status, waited

    monkeypatch.setattr(cpu_gemv.BoundPart, "run", counted)
    measured = measure_host_experts("bf16", 256, 128, 2, [1, 2], budget_s=0.02, progress=ProgressSink(),
                                    weight=1.0, on_worker=True)
    assert set(measured.worker) == {"1", "2"} and all(rate > 0 for rate in measured.worker.values())
    if one_call:
        assert runs and set(runs) == {(0, 1)}  # computed (the word was up), the ticket raised
    else:
        assert runs == []
