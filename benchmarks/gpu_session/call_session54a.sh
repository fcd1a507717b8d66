# ~8 min (written 2026-12-07 in session 54). Session 54's compute check (profile/drift.py: the host's CPU
# products at 8, 16, 64 and 512 rows timed against the profile's when an engine loads; VRAMSHARD_COMPUTE_DRIFT):
# its tests and the packed parts' (CPU and GPU), the planner's tier-64 placements of llama3-8b at 8 GiB family by
# family with it (step_profile), then llama3-8b at 8 GiB batch 64 against layers:max with the check on and off
# (ORDER, default "on off").
# SKIP_TIER=1: not the family comparison (a shorter call: `SKIP_TIER=1 ORDER=on`, ~4 min).
source benchmarks/gpu_session/setup.sh || exit 1
timeout 90 python3 -m pytest -q -rs -p no:cacheprovider tests/test_drift.py tests/test_cpu_packed.py > $OUT/pytest_drift.txt 2>&1
echo "drift tests rc $?"; tail -1 $OUT/pytest_drift.txt
timeout 60 python3 -m benchmarks.compute_drift --profile "$PROFILE" --budget-s 0.1 > $OUT/compute_drift.log 2>&1
echo "compute_drift rc $?"; grep -E "by rows|within|x plain" $OUT/compute_drift.log | cut -c1-300
[ -z "$SKIP_TIER" ] && timeout ${TIER_S:-150} python3 -m benchmarks.step_profile --shape llama3-8b --seqs 64 \
  --ctx 32 --steps 10 --warmup 12 --rows 5 \
  --placements planned:8/search,planned:8/split,planned:8/dynamic,planned:8/static \
  --profile "$PROFILE" --json $OUT/tier64.json > $OUT/tier64.log 2>&1; echo "tier64 rc $?"
grep -E "CPU .* now / when profiled|compute by rows|prepacked at|memory read" $OUT/tier64.log | cut -c1-300
python3 - <<'PY'
import json, os
path = os.path.join(os.environ["OUT"], "tier64.json")
for r in json.load(open(path))["placements"] if os.path.exists(path) else []:
    print(r["placement"], r.get("error") or {k: round(r[k], 1) for k in ("wall_ms", "predicted_ms", "host_compute_ms",
                                                                         "host_wait_ms") if k in r})
PY
switch_runs VRAMSHARD_COMPUTE_DRIFT "${ORDER:-on off}" b64 ${B64_S:-150} --models llama3-8b --budgets 8 \
  --batch-sizes 64 --repeat 1 --deadline-s 130 --run-limit-s 10
grep -hE "now / when profiled|compute by rows|prepacked at" $OUT/b64_*.log | cut -c1-300
