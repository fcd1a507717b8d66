# ~8 min (written 2026-12-06 in session 42). Session 42 gives MoE layers' host experts to the run-ahead worker by
# default (VRAMSHARD_RUN_AHEAD=auto; `on` adds split dense FFNs' CPU parts) and keeps a plan's worker team
# below half the cores within the team tuner's reach. The GPU suite; then llama3-8b's planned one-token step at
# 8 and 2 GiB with dense run-ahead off and on (benchmarks.step_profile, NAME+ahead), twice in one process;
# then qwen3-30b-a3b at 8 GiB, planned and experts-cpu, with the default (auto) and VRAMSHARD_RUN_AHEAD=off.
source benchmarks/gpu_session/setup.sh || exit 1
rm -f $OUT/commit.txt
gpu_suite ${SUITE_SECONDS:-300}
PLACEMENTS=planned:8,planned:8+ahead,planned:2,planned:2+ahead,planned:8,planned:8+ahead,planned:2,planned:2+ahead
timeout 200 python3 -m benchmarks.step_profile --shape llama3-8b --placements $PLACEMENTS \
  --profile "$PROFILE" --steps 30 --warmup 20 --rows 5 --json $OUT/dense_ahead.json > $OUT/dense_ahead.log 2>&1
echo "step_profile rc $? load $(cut -d' ' -f1-3 /proc/loadavg)"
step_summary $OUT/dense_ahead.json
moe_ahead_runs "auto off" 48
