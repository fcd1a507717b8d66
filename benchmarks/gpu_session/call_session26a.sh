# ~9.5 min (written 2026-12-05, session 26): a full profile, then the MoE run-ahead cell planned from it.
# 1. `vramshard profile` (full): its wall time (the Profiler issue wants <= 10 min), and the profile the
#    second call compares with (copy $OUT/profile.json to docs/profiles/h200-run26.json; call_session26b.sh).
# 2. qwen3-30b-a3b at 8 GiB, batch 1, run-ahead on: the planner's plan, the kernels alone and with the
#    CPU's share, every estimate from this machine's fresh profile (the stored h200-run15.json
#    predicted 22.9 tok/s for the share in the twenty-third session, measured 15.3).
source benchmarks/gpu_session/setup.sh || exit 1
start=$(date +%s)
timeout 400 python3 -m vramshard.cli.main profile --out $OUT/profile.json > $OUT/profile.log 2>&1; echo "profile rc $? in $(( $(date +%s) - start )) s"
tail -3 $OUT/profile.log | cut -c1-200
PROFILE=$OUT/profile.json; test -s $PROFILE || PROFILE=docs/profiles/h200-run15.json
VRAMSHARD_RUN_AHEAD=on timeout 175 python3 -m benchmarks.moe_bench --budgets 8 --batches 1 --time-limit 130 \
  --placements planned,experts-zero-copy,experts-zero-copy-cpu --profile $PROFILE --out $OUT/moe_run_ahead.json \
  > $OUT/moe_run_ahead.log 2>&1; echo "moe rc $?"
grep -iE "tok/s|error" $OUT/moe_run_ahead.log | tail -8 | cut -c1-240
