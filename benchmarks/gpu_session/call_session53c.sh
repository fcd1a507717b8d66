# ~2.5 min (written 2026-12-07 in session 53, with five minutes of device time left): the first two steps of
# call_session53b.sh alone: copies alone / beside the old CPU load / beside the new one, then the GPU tests of the
# profile and the drift checks (the code session 53 changed on the GPU path).
source benchmarks/gpu_session/setup.sh || exit 1
timeout 45 python3 -m benchmarks.copy_contention --seconds 1 > $OUT/copy_contention.log 2>&1
echo "copy_contention rc $?"; grep -E "bound|copies" $OUT/copy_contention.log | cut -c1-200
timeout ${TESTS_S:-120} python3 -m pytest -m gpu -q -rfEs --tb=short -p no:cacheprovider tests/test_profile.py \
  tests/test_drift.py > $OUT/pytest_gpu_profile.txt 2>&1
echo "profile/drift tests rc $?"; tail -2 $OUT/pytest_gpu_profile.txt
grep -E "^(FAILED|ERROR)" $OUT/pytest_gpu_profile.txt | cut -c1-250
