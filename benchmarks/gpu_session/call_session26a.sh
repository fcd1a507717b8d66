# ~9.5 min (written 2026-12-05, session 26): the MoE share's GPU tests, a full profile, and the MoE
# run-ahead cells planned from it.
# 1. The GPU tests of the CPU's share of zero-copy experts and of the run-ahead worker (tests/test_moe.py):
#    the planner now gives decode tiers a share, which the executor takes from its plan.
# 2. `vramshard profile` (full; since session 26 it also times the CPU's expert pass on a worker thread
#    beside Python): its wall time (the Profiler issue wants <= 10 min), and the profile the second call
#    compares with (copy $OUT/profile.json to docs/profiles/h200-run26.json; call_session26b.sh).
# 3. qwen3-30b-a3b at 8 GiB, batch 1, run-ahead on, from this fresh profile: the planner's plan (with its
#    share), the kernels alone, and the shares 3/8 and 2/8; a ~65 s build, then ~25 s a cell. The
#    twenty-third session measured 4/8: 15.32 tok/s against 12.45 alone, where the estimator said 22.9.
source benchmarks/gpu_session/setup.sh || exit 1
timeout 75 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_moe.py -k "zero_copy or run_ahead or shared" \
  > $OUT/pytest_gpu_moe.txt 2>&1; tail -1 $OUT/pytest_gpu_moe.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest_gpu_moe.txt | cut -c1-250
start=$(date +%s)
timeout 370 python3 -m vramshard.cli.main profile --out $OUT/profile.json > $OUT/profile.log 2>&1; echo "profile rc $? in $(( $(date +%s) - start )) s"
tail -3 $OUT/profile.log | cut -c1-200
PROFILE=$OUT/profile.json; test -s $PROFILE || PROFILE=docs/profiles/h200-run15.json
VRAMSHARD_RUN_AHEAD=on timeout 165 python3 -m benchmarks.moe_bench --budgets 8 --batches 1 --time-limit 150 \
  --no-skewed --placements planned,experts-zero-copy --shares 0.375,0.25 --profile $PROFILE --out $OUT/moe_run_ahead.json \
  > $OUT/moe_run_ahead.log 2>&1; echo "moe rc $?"
grep -oE "'placement': '[^']*'|'zero_copy_cpu_share': [0-9.]*|'predicted_decode_tok_s': [0-9.]*|'decode_tok_s': [0-9.]*|'error': '[^']{0,120}" $OUT/moe_run_ahead.log | tr '\n' ' ' | sed 's/.placement/\n&/g'
