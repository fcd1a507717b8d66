"""benchmarks/profile_check.py's ``--against``: an earlier call's saved profile as run 1, one profile
measured as run 2 (two full profiles do not fit one 10-minute call on the GPU machine). The
measurements are faked here; the file checks and the comparison are the real ones."""

import copy
import json
from pathlib import Path

import pytest

from benchmarks import profile_check
from vramshard.errors import ProfileError
from vramshard.profile import save, synthetic
from vramshard.profile.fingerprint import fingerprint_hash, machine_fingerprint
from vramshard.profile.query import Profile

H200 = Path(__file__).resolve().parent.parent / "docs" / "profiles" / "h200-run15.json"


def this_machines(profile: Profile) -> Profile:
    data = copy.deepcopy(profile.data)
    data["fingerprint"] = machine_fingerprint()
    data["fingerprint_hash"] = fingerprint_hash(data["fingerprint"])
    return Profile(data)


@pytest.fixture
def faked_runs(monkeypatch):
    """Profiles "measured" (each a synthetic one of this machine, the second with faster copies),
    and no CPU probes or held-out timings; returns the list of the runs made."""
    runs = []

    def run_profile(spec):
        runs.append(spec)
        return this_machines(synthetic(gpu_gflops=50_000, h2d_gbps=25.0 * (1 + 0.1 * len(runs))))

    monkeypatch.setattr(profile_check, "run_profile", run_profile)
    monkeypatch.setattr(profile_check, "cpu_probe", lambda when: {"when": when, "seconds": {"probe": 1e-3}})
    monkeypatch.setattr(profile_check, "held_out", lambda profile: [])
    return runs


def test_against_compares_a_saved_profile_with_one_measured_run(tmp_path, faked_runs):
    saved = save(this_machines(synthetic(gpu_gflops=50_000, h2d_gbps=25.0)), tmp_path / "earlier" / "profile_run1.json")
    out = tmp_path / "check.json"
    assert profile_check.main(["--against", str(saved), "--out", str(out)]) == 0
    assert len(faked_runs) == 1  # only run 2 is measured
    report = json.loads(out.read_text())
    assert report["run1_file"] == str(saved) and report["run1_elapsed_s"] is None
    assert report["second_run_quick"] is False and report["held_out_profile"] == "run 2"
    assert report["difference_pct"]["h2d GB/s alone"] == pytest.approx(10.0, abs=0.5)  # 25 -> 27.5 GB/s
    assert (tmp_path / "profile_run2.json").exists()


def test_without_against_both_runs_are_measured(tmp_path, faked_runs):
    out = tmp_path / "check.json"
    assert profile_check.main(["--quick", "--out", str(out)]) == 0
    assert len(faked_runs) == 2
    assert json.loads(out.read_text())["run1_file"] is None


def test_against_another_machines_or_a_corrupt_profile_fails_before_any_run(tmp_path, faked_runs):
    with pytest.raises(ProfileError):
        profile_check.main(["--against", str(H200), "--out", str(tmp_path / "check.json")])  # the H200 machine's
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text("{")
    with pytest.raises(ProfileError):
        profile_check.main(["--against", str(corrupt), "--out", str(tmp_path / "check.json")])
    assert faked_runs == [] and not (tmp_path / "check.json").exists()


def test_each_cpu_point_is_corrected_by_the_drift_of_the_nearest_measured_point(monkeypatch):
    """A machine uniformly 30% slower than its profile: every CPU point's plain error is -23%, and
    its drift-corrected one 0. A point slower than its reference keeps that difference."""
    profile = Profile(copy.deepcopy(json.loads(H200.read_text())))
    profile.data["matmul"] = [t for t in profile.data["matmul"] if t["device"] == "cpu"]  # a CPU-only check
    profile = Profile(profile.data)
    slow = {"by": 1.3}

    def time_matmul(m, k, n, dtype, device):
        extra = 1.5 if (m, k, n) == (8, 3072, 9216) else 1.0  # this point alone off its table
        return profile.matmul_s(m, k, n, dtype, device) * slow["by"] * extra

    def time_attention(n_new, context, dtype, device):
        return profile.attention_s(n_new, context, 32, 8, 128, dtype, device) * slow["by"]

    monkeypatch.setattr(profile_check, "time_matmul", time_matmul)
    monkeypatch.setattr(profile_check, "time_attention", time_attention)
    rows = profile_check.held_out(profile)
    assert {r["device"] for r in rows} == {"cpu"} and len(rows) == 3 * (7 + 3 + 3)
    for row in rows:
        odd = row["shape"] == [8, 3072, 9216]
        assert row["error_pct"] == pytest.approx(100 * (1 / (1.3 * (1.5 if odd else 1.0)) - 1))
        assert row["drift_corrected_error_pct"] == pytest.approx(100 * (1 / 1.5 - 1) if odd else 0.0, abs=1e-9)
    assert profile_check.within_20(rows)["matmul cpu bf16"] == (0, 7)
    assert profile_check.within_20(rows, "drift_corrected_error_pct")["matmul cpu bf16"] == (6, 7)


def test_the_reference_of_a_point_is_the_nearest_other_measured_point():
    profile = Profile(json.loads(H200.read_text()))
    # M 3 -> 4; 4096 x 6144 (25.2M weights) -> 5120 x 5120 (26.2M), the nearest measured shape
    assert profile_check.matmul_reference(profile, 3, 4096, 6144, "bf16", "cpu") == (4, 5120, 5120)
    # a grid point is never its own reference: the same M, the nearest other shape
    assert profile_check.matmul_reference(profile, 64, 4096, 14336, "bf16", "cpu") == (64, 14336, 4096)
    assert profile_check.attention_reference(profile, 8, 3000, "bf16", "cpu") == (16, 2048)


def test_the_host_read_is_a_main_figure_when_both_profiles_recorded_it():
    first = synthetic(gpu_gflops=50_000, h2d_gbps=25.0).summary()
    second = synthetic(gpu_gflops=50_000, h2d_gbps=25.0).summary()
    assert "host memory read GB/s" not in profile_check.compare(first, second)  # (profiles before 2026-12-04)
    first["cpu_read_gb_s"], second["cpu_read_gb_s"] = 100.0, 90.0
    assert profile_check.compare(first, second)["host memory read GB/s"] == pytest.approx(-10.0)


def test_the_check_says_what_ran_beside_each_run_where_the_profile_recorded_it():
    """``beside_line``: the cores others and steal took beside a profile (``host_beside``, since 2026-12-07), its
    busiest tables first; an older profile says it was not recorded."""
    data = copy.deepcopy(synthetic(gpu_gflops=50_000).data)
    assert profile_check.beside_line("run 1", Profile(data)) == "run 1: not recorded"
    data["host_beside"] = {"others_cores": 0.5, "steal_cores": 0.25, "own_cores": 15.5, "by_table": {
        "cpu matmul bf16 threads=16": {"others_cores": 0.1, "steal_cores": 0.0, "own_cores": 16.0},
        "cpu matmul fp32 threads=16": {"others_cores": 2.0, "steal_cores": 1.5, "own_cores": 15.0}}}
    line = profile_check.beside_line("run 2", Profile(data))
    assert line.startswith("run 2: 0.50 cores busy with other work, 0.25 stolen, 15.50 with the profile's, 0 CPU")
    assert line.index("fp32 threads=16 (2.00, 1.50 stolen)") < line.index("bf16 threads=16 (0.10, 0.00 stolen)")
