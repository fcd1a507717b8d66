# ~1 min: the GPU tests of the engine's budget following, re-planning and batching (after a
# change to budget_follower.py that the full GPU run of the session did not cover).
source benchmarks/gpu_session/setup.sh || exit 1
timeout 150 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/test_budget.py tests/test_engine_batching.py \
  tests/test_calibrate.py > $OUT/pytest_gpu_budget.txt 2>&1; tail -3 $OUT/pytest_gpu_budget.txt
grep -E "^(FAILED|ERROR)" $OUT/pytest_gpu_budget.txt | cut -c1-250
