"""Profiler: measurement round trip, the profile file, interpolation, synthetic profiles."""

import json
import logging
import os

import pytest
import torch

from vramshard.profile.bench_matmul import cold_copies
import torch.nn.functional as F

from vramshard.errors import InvalidInputError, ProfileError
from vramshard.profile import BenchmarkSpec, Profile, load, load_or_none, profile_path, save, synthetic
from vramshard.profile import store
from vramshard.profile.fingerprint import fingerprint_hash, machine_fingerprint
from vramshard.profile.runner import run_profile
from vramshard.profile.tables import MatmulTable, interp_log
from vramshard.profile.timing import time_cpu

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def tiny_spec(**overrides) -> BenchmarkSpec:
    """A spec that measures in a second or two on 2 cores."""
    spec = BenchmarkSpec(
        ms=[1, 8, 64], shapes=[(256, 256), (512, 512), (1024, 1024)], dtypes=["fp32", "bf16"], threads=[1, 2],
        ratio_shapes=[(512, 512)], ratio_ms=[1, 64], transfer_sizes=[2**16, 2**20, 2**22],
        attention_n_new=[1, 8], attention_context=[128, 512], attention_heads=[(4, 2, 64)],
        point_budget_s=0.01, point_cap_s=0.1, gpu_point_budget_s=0.005, gpu=False, quick=True,
    )
    for key, value in overrides.items():
        setattr(spec, key, value)
    return spec


@pytest.fixture(scope="module")
def tiny_profile() -> Profile:
    return run_profile(tiny_spec())


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VRAMSHARD_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


# --- measurement and round trip -------------------------------------------------------------

def test_round_trip_through_cache(tiny_profile, cache):
    path = save(tiny_profile)
    assert path == profile_path() and path.parent == cache
    assert path.stat().st_size < 300 * 1024
    loaded = load()
    assert loaded.to_dict() == json.loads(json.dumps(tiny_profile.to_dict()))
    for args in [(1, 512, 512), (8, 1024, 1024), (37, 700, 900), (5000, 4096, 4096)]:
        assert loaded.matmul_s(*args, "fp32", "cpu") == pytest.approx(tiny_profile.matmul_s(*args, "fp32", "cpu"))
        assert loaded.matmul_s(*args, "fp32", "cpu") > 0
    assert loaded.attention_s(4, 300, 4, 2, 64, "bf16", "cpu") > 0
    assert loaded.dispatch_s("cpu") > 0
    assert load_or_none() is not None


def test_cpu_only_profile_has_no_gpu_data(tiny_profile):
    assert not tiny_profile.has_gpu
    assert tiny_profile.summary()["transfer_gbps"] == {}
    for query in (
        lambda: tiny_profile.matmul_s(1, 512, 512, "bf16", "cuda"),
        lambda: tiny_profile.transfer_s(2**20),
        lambda: tiny_profile.attention_s(1, 128, 4, 2, 64, "bf16", "cuda:0"),
        lambda: tiny_profile.dispatch_s("cuda"),
    ):
        with pytest.raises(ProfileError, match="no GPU data"):
            query()


def test_unmeasured_dtype_and_bad_arguments(tiny_profile):
    with pytest.raises(ProfileError, match="fp16"):
        tiny_profile.matmul_s(1, 512, 512, torch.float16, "cpu")
    with pytest.raises(InvalidInputError):
        tiny_profile.matmul_s(1, 512, 512, "int8", "cpu")
    with pytest.raises(InvalidInputError):
        tiny_profile.matmul_s(1, 512, 512, "fp32", "tpu")
    with pytest.raises(InvalidInputError):
        tiny_profile.matmul_s(1, 512, 512, "fp32", "cpu", threads=0)
    assert tiny_profile.matmul_s(0, 512, 512, "fp32", "cpu") == 0.0


def test_spec_rejects_ratio_grid_outside_full_grid():
    with pytest.raises(InvalidInputError, match="subsets"):
        run_profile(tiny_spec(ratio_shapes=[(333, 333)]))


# --- the file -------------------------------------------------------------------------------

@pytest.mark.parametrize("fail_at", ["fsync", "replace"])
def test_interrupted_write_leaves_no_file(tiny_profile, tmp_path, monkeypatch, fail_at):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(store.os, fail_at, interrupt)
    target = tmp_path / "p.json"
    with pytest.raises(KeyboardInterrupt):
        save(tiny_profile, target)
    assert list(tmp_path.iterdir()) == []


def test_interrupted_overwrite_keeps_old_file(tiny_profile, tmp_path, monkeypatch):
    target = save(tiny_profile, tmp_path / "p.json")
    before = target.read_bytes()
    monkeypatch.setattr(store.os, "replace", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        save(synthetic(), target)
    assert target.read_bytes() == before and len(list(tmp_path.iterdir())) == 1


@pytest.mark.parametrize("damage", ["garbage", "truncated", "negative", "schema"])
def test_corrupt_file_is_rejected_clearly(tiny_profile, tmp_path, damage):
    target = save(tiny_profile, tmp_path / "p.json")
    text = target.read_text()
    data = json.loads(text)
    if damage == "garbage":
        target.write_bytes(b"\x00\xffnot json")
    elif damage == "truncated":
        target.write_text(text[: len(text) // 2])
    elif damage == "negative":
        data["matmul"][0]["seconds"][0][0] = -1.0
        target.write_text(json.dumps(data))
    else:
        del data["schema"]
        target.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="corrupt") as info:
        load(target)
    assert str(target) in str(info.value) and "vramshard profile" in str(info.value)


def test_foreign_fingerprint_is_rejected(tiny_profile, cache, caplog):
    data = json.loads(json.dumps(tiny_profile.to_dict()))
    data["fingerprint"]["cpu_model"] = "Some Other CPU 9000"
    data["fingerprint_hash"] = fingerprint_hash(data["fingerprint"])
    foreign = save(Profile(data))
    assert foreign != profile_path()
    with pytest.raises(ProfileError, match="different machine") as info:
        load(foreign)
    assert "Some Other CPU 9000" in str(info.value)
    with caplog.at_level(logging.WARNING):
        assert load_or_none() is None
    assert "another machine" in caplog.text and foreign.name in caplog.text
    # a foreign file copied under this machine's name is not used either
    os.replace(foreign, profile_path())
    with pytest.raises(ProfileError, match="different machine"):
        load()
    assert load_or_none() is None


def test_fingerprint_is_stable():
    first, second = machine_fingerprint(), machine_fingerprint()
    assert fingerprint_hash(first) == fingerprint_hash(second)
    assert fingerprint_hash(dict(reversed(list(first.items())))) == fingerprint_hash(first)
    assert first["cpu_count"] >= 1 and first["torch"] == torch.__version__


# --- interpolation ----------------------------------------------------------------------------

def test_interp_log_exact_on_power_laws_and_extrapolates_by_throughput():
    xs, ys = [1, 10, 100], [1.0, 10.0**0.5, 10.0]
    assert interp_log(30, xs, ys) == pytest.approx(30**0.5)
    assert interp_log(0.1, xs, ys) == 1.0  # clamped below
    assert interp_log(1000, xs, ys) == pytest.approx(100.0)  # constant throughput above
    table = MatmulTable([(64, 64), (256, 256)], [1, 100], [[1e-5, 1e-3], [1.6e-4, 1.6e-2]])
    assert table(10, 128, 128) == pytest.approx(1e-5 * 10 * 4)  # work ∝ m * k * n here


def _held_out_errors() -> list[float]:
    spec = tiny_spec(
        ms=[1, 16, 64, 256], shapes=[(512, 512), (1024, 1024), (2048, 2048), (4096, 4096)], dtypes=["fp32"],
        threads=[torch.get_num_threads()], ratio_shapes=[(1024, 1024)], ratio_ms=[16],
        attention_n_new=[1], attention_context=[128], point_budget_s=0.05, point_cap_s=0.5,
    )
    profile = run_profile(spec)
    held_out = [(32, 1024, 1024), (64, 1536, 1536), (128, 2048, 1024), (16, 3072, 3072), (100, 4096, 2048)]
    errors = []
    for m, k, n in held_out:
        x = torch.randn(m, k)
        weights = cold_copies(torch.randn(n, k))  # as the model runs: weights come from memory
        turn = [0]

        def fn():
            turn[0] = (turn[0] + 1) % len(weights)
            return F.linear(x, weights[turn[0]])

        with torch.inference_mode():
            direct = time_cpu(fn, 0.1)
        predicted = profile.matmul_s(m, k, n, "fp32", "cpu")
        errors.append(abs(predicted - direct) / direct)
    return errors


def test_held_out_shapes_match_direct_measurement():
    """Interpolated times within 50% of a direct measurement (noisy 2-core CI machine).

    The shared CI machine has seconds-long slow spells, so up to five attempts are made;
    a broken interpolation fails every one.
    """
    for _ in range(5):
        errors = _held_out_errors()
        if max(errors) < 0.5:
            break
    assert max(errors) < 0.5, f"relative errors {[f'{e:.0%}' for e in errors]}"


# --- synthetic profiles --------------------------------------------------------------------

def test_synthetic_profile_is_monotonic():
    profile = synthetic(cpu_gflops=500, gpu_gflops=50_000, h2d_gbps=25, cpu_threads=16)
    for device in ("cpu", "cuda"):
        times = [profile.matmul_s(m, 4096, 4096, "bf16", device) for m in (1, 3, 16, 100, 1000, 4096)]
        assert times == sorted(times) and len(set(times)) == len(times)
        times = [profile.matmul_s(64, k, k, "bf16", device) for k in (300, 1000, 3000, 9000, 20000)]
        assert times == sorted(times)
        times = [profile.attention_s(4, c, 32, 8, 128, "bf16", device) for c in (100, 1000, 5000, 60000)]
        assert times == sorted(times)
    threads = [profile.matmul_s(256, 4096, 14336, "bf16", "cpu", threads=t) for t in range(1, 17)]
    assert threads == sorted(threads, reverse=True)
    assert profile.matmul_s(64, 4096, 4096, "bf16", "cpu", contended=True) > profile.matmul_s(64, 4096, 4096, "bf16", "cpu")
    sizes = [profile.transfer_s(b) for b in (1000, 2**16, 2**20, 3 * 2**20, 2**30, 2**33)]
    assert sizes == sorted(sizes)
    assert profile.transfer_s(2**28, contended=True) > profile.transfer_s(2**28)
    assert profile.transfer_s(2**30) == pytest.approx(2**30 / 25e9, rel=0.01)


def test_synthetic_knobs_move_times_the_right_way():
    base = synthetic(cpu_gflops=500, gpu_gflops=50_000, h2d_gbps=25)
    slow_pcie = synthetic(cpu_gflops=500, gpu_gflops=50_000, h2d_gbps=2)
    fast_cpu = synthetic(cpu_gflops={"bf16": 5000, "fp16": 500, "fp32": 500}, gpu_gflops=50_000, cpu_mem_gbps=600)
    assert slow_pcie.transfer_s(2**28) > 10 * base.transfer_s(2**28)
    assert slow_pcie.transfer_s(2**28, "d2h") > 10 * base.transfer_s(2**28, "d2h")
    assert fast_cpu.matmul_s(1024, 4096, 4096, "bf16", "cpu") < base.matmul_s(1024, 4096, 4096, "bf16", "cpu") / 5
    assert fast_cpu.matmul_s(1024, 4096, 4096, "fp32", "cpu") == pytest.approx(base.matmul_s(1024, 4096, 4096, "fp32", "cpu"))
    cpu_only = synthetic(cpu_gflops=300)
    assert not cpu_only.has_gpu and cpu_only.matmul_s(1, 4096, 4096, "bf16", "cpu") > 0
    with pytest.raises(ProfileError, match="no GPU data"):
        cpu_only.transfer_s(2**20)
    assert Profile.from_dict(json.loads(json.dumps(base.to_dict()))).summary() == base.summary()


# --- command line ----------------------------------------------------------------------------

def test_cli_show_existing_profile(tiny_profile, tmp_path, capsys):
    from vramshard.cli.main import main

    path = save(tiny_profile, tmp_path / "p.json")
    assert main(["profile", "--show", "--out", str(path)]) == 0
    out = capsys.readouterr().out
    assert "peak matmul GFLOP/s" in out and "CPU-only" in out and "dispatch" in out
    assert main(["profile", "--threads", "a,b"]) == 3


# --- GPU ---------------------------------------------------------------------------------------

@pytest.mark.gpu
@requires_cuda
def test_gpu_profile_round_trip(tmp_path):
    profile = run_profile(tiny_spec(gpu=True, threads=[torch.get_num_threads()], ratio_shapes=[(512, 512)]))
    loaded = load(save(profile, tmp_path / "g.json"))
    assert loaded.has_gpu
    assert loaded.matmul_s(64, 1024, 1024, "bf16", "cuda") > 0
    assert loaded.attention_s(8, 512, 4, 2, 64, "bf16", "cuda") > 0
    assert loaded.dispatch_s("cuda") > 0
    sizes = [loaded.transfer_s(b, d) for d in ("h2d", "d2h") for b in (2**16, 2**22, 2**24)]
    assert sizes[0] < sizes[2] and sizes[3] < sizes[5]
    assert loaded.transfer_s(2**22, contended=True) > 0
    assert loaded.matmul_s(64, 512, 512, "fp32", "cpu", contended=True) > 0
    summary = loaded.summary()
    assert summary["transfer_gbps"]["h2d"]["alone"] > 0.5 and "cuda" in summary["matmul_peak_gflops"]


def test_background_load_runs_and_reports_its_failure():
    import time

    from vramshard.profile import contention

    with contention.cpu_load(m=4, k=256, n=512):
        time.sleep(0.1)

    def broken():
        raise ValueError("boom")

    with pytest.raises(RuntimeError, match="test load failed"):
        with contention._background("test load", broken):
            time.sleep(0.1)
