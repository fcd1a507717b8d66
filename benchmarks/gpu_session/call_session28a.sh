# ~9.5 min on a FRESH machine (written 2026-12-05 in session 28). Two session-28 changes are not yet
# measured: the host experts pass now runs in parallel over every assignment's rows (it could run over
# the experts alone: 8 threads for a token's 8 experts, 3 for a share of 3), and a profile times the
# run-ahead worker's team (15/12/8/4 threads) and the planner gives decode tiers the fastest.
# 1. A full profile with both (the Profiler issue's duration, where its time went, the new CPU expert
#    rates and the team timings). Keep $OUT/profile.json as docs/profiles/h200-run28a.json: the next
#    call (call_session28b.sh, same boot) checks a second profile against it.
# 2. qwen3-30b-a3b at 8 GiB, 1K context, run-ahead on: the kernels alone and the plan from that profile.
source benchmarks/gpu_session/setup.sh || exit 1
timeout 400 python3 -m vramshard.cli.main profile --out $OUT/profile.json > $OUT/profile.log 2>&1; echo "profile rc $?"
tail -3 $OUT/profile.log | cut -c1-200
COLUMNS=200 python3 -m vramshard.cli.main profile --show --out $OUT/profile.json 2>&1 | grep -vE "^[┏┡└│┃]" | cut -c1-260 | head -24
PROFILE=$OUT/profile.json; [ -s $PROFILE ] || PROFILE=docs/profiles/h200-run26b.json
VRAMSHARD_RUN_AHEAD=on timeout 180 python3 -m benchmarks.moe_bench --budgets 8 --batches 1 --time-limit 160 --no-skewed \
  --placements experts-zero-copy,planned --profile $PROFILE --out $OUT/moe_planned.json > $OUT/moe_planned.log 2>&1; echo "moe rc $?"
FIELDS="'placement': '[^']*'|'zero_copy_cpu_share': [0-9.]*|'decode_tok_s': [0-9.]*|'predicted_decode_tok_s': [0-9.]*|'bound_tok_s': [0-9.]*|'decode_step_ms': [0-9.]*|'decode_host_compute_ms': [0-9.]*|'decode_worker_longest_part_ms': [0-9.]*|'decode_worker_expert_kernel_ms': [0-9.]*|'decode_worker_team': [0-9]*"
grep -oE "$FIELDS" $OUT/moe_planned.log | tr '\n' ' ' | sed 's/.placement/\n&/g'
