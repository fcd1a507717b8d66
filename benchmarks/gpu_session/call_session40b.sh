# ~6 min (written 2026-12-06 in session 40). qwen3-30b-a3b at 8 GiB, experts-cpu, run-ahead on, by the worker's
# OpenMP team (VRAMSHARD_WORKER_THREADS 15, 14, 12, 15 again). In the thirty-fifth session's steps the worker's
# kernel took 0.53 ms a layer where the same kernel alone took 0.40 at 15 threads and 0.49 at 16
# (benchmarks.kernel_revisions on that host): a team as large as the cores left beside the host thread may wait
# for a thread the host's other work took off its core. If a smaller team is faster in the step, the default
# team (one core fewer than the step's threads) should be smaller by that much.
source benchmarks/gpu_session/setup.sh || exit 1
rm -f $OUT/commit.txt
FIELDS="'decode_tok_s': [0-9.]*|'bound_tok_s': [0-9.]*|'decode_step_ms': [0-9.]*|'decode_worker_team': [0-9]*|'decode_worker_expert_kernel_ms': [0-9.]*|'decode_worker_idle_ms': [0-9.]*"
i=0
for team in 15 14 12 15; do
  i=$((i + 1))
  VRAMSHARD_WORKER_THREADS=$team VRAMSHARD_RUN_AHEAD=on timeout 85 python3 -m benchmarks.moe_bench --budgets 8 \
    --batches 1 --time-limit 70 --no-skewed --placements experts-cpu --profile "$PROFILE" \
    --out $OUT/moe_team${team}_$i.json > /tmp/moe.log 2>&1
  echo "team $team rc $?"; grep -oE "$FIELDS" /tmp/moe.log | tr '\n' ' '; echo
done
