# ~4 min (written 2026-12-06 in session 47). The gpu-marked quick-then-full re-plan test after its fix (its GPU
# variant kept the real steps' CPU timing, so the engine judged that CPU work instead of fitting), then one more
# pair of qwen3-30b-a3b runs at 8 GiB with VRAMSHARD_RUN_AHEAD_ONE_CALL off and on (as call_session47a.sh).
source benchmarks/gpu_session/setup.sh || exit 1
timeout 90 python3 -m pytest -m gpu -q -rfE --tb=short -p no:cacheprovider tests/test_calibrate.py > $OUT/pytest_calibrate.txt 2>&1
echo "calibrate tests rc $?"; tail -2 $OUT/pytest_calibrate.txt; grep -E "^(FAILED|ERROR|E )" $OUT/pytest_calibrate.txt | head -20
ONE_CALL_RUNS="${ONE_CALL_RUNS:-off on}" bash benchmarks/gpu_session/call_session47a.sh --moe-only
