# ~7 min (written 2026-12-07 in session 53). The profiler's CPU load beside its PCIe timings is now decode's CPU
# work over cold weights (profile/contention.py), and an engine may time its copies beside the CPU when it loads
# (VRAMSHARD_COPY_DRIFT, profile/drift.py; off by default). Here: host→device copies alone, beside the old load and
# beside the new one, with the shared-read bound (benchmarks/copy_contention.py); the GPU tests of the profile and
# the drift checks; then llama3-8b at 8 GiB against layers:max, both engines loaded and stepped in turns
# (benchmarks/paired_decode.py), with VRAMSHARD_COPY_DRIFT off and then on (look for "copies beside the CPU").
source benchmarks/gpu_session/setup.sh || exit 1
timeout 60 python3 -m benchmarks.copy_contention --seconds 1 > $OUT/copy_contention.log 2>&1
echo "copy_contention rc $?"; grep -E "bound|copies" $OUT/copy_contention.log | cut -c1-200
timeout ${TESTS_S:-120} python3 -m pytest -m gpu -q -rfEs --tb=short -p no:cacheprovider tests/test_profile.py tests/test_drift.py \
  > $OUT/pytest_gpu_profile.txt 2>&1
echo "profile/drift tests rc $?"; tail -2 $OUT/pytest_gpu_profile.txt
grep -E "^(FAILED|ERROR)" $OUT/pytest_gpu_profile.txt | cut -c1-250
for drift in ${DRIFTS:-off on}; do
  VRAMSHARD_COPY_DRIFT=$drift timeout ${PAIR_S:-140} python3 -m benchmarks.paired_decode --model llama3-8b --budgets 8 \
    --pps 1024 --rounds ${ROUNDS:-6} --steps 16 --profile "$PROFILE" --json $OUT/paired_$drift.json \
    > $OUT/paired_$drift.log 2>&1
  echo "paired copy drift $drift rc $?"
  grep -E "copies beside|planning with the profile" $OUT/paired_$drift.log | cut -c1-220
  grep -oE "'speedup_median': [0-9.]*|'planned_step_ms_median': [0-9.]*|'baseline_step_ms_median': [0-9.]*|'host_read_gb_s_range': [^]]*]" \
    $OUT/paired_$drift.log | tr '\n' ' '; echo
done
