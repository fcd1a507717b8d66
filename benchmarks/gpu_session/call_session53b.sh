# ~3 min (written 2026-12-07 in session 53). The profiler's CPU load beside its PCIe timings is now decode's CPU
# work over cold weights (profile/contention.py): host→device copies alone, beside the old load and beside the new
# one, with the shared-read bound (benchmarks/copy_contention.py); the profile's GPU tests (the contended transfer
# tables now say what the CPU read); then a quick profile, whose contended h2d table the new load priced.
source benchmarks/gpu_session/setup.sh || exit 1
timeout 60 python3 -m benchmarks.copy_contention --seconds 2 > $OUT/copy_contention.log 2>&1
echo "copy_contention rc $?"; grep -E "bound|copies" $OUT/copy_contention.log | cut -c1-200
timeout 150 python3 -m pytest -m gpu -q -rfEs --tb=short -p no:cacheprovider tests/test_profile.py \
  > $OUT/pytest_gpu_profile.txt 2>&1
echo "profile tests rc $?"; tail -2 $OUT/pytest_gpu_profile.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest_gpu_profile.txt | cut -c1-250
timeout 150 python3 -m vramshard.cli.main profile --quick --out $OUT/quick.json > $OUT/quick.log 2>&1; echo "quick profile rc $?"
python3 - <<'PY'
import json, os
path = os.path.join(os.environ["OUT"], "quick.json")
if os.path.exists(path):
    data = json.load(open(path))
    for t in data["transfer"]:
        print(t["direction"], "contended" if t["contended"] else "alone", t.get("load_cpu_gbps"),
              [round(b / s / 1e9, 1) for b, s in zip(t["bytes"], t["seconds"])][-3:])
    print("elapsed", data.get("elapsed_s"))
PY
