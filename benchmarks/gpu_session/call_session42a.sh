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
python3 - <<'PY'
import json, os
path = os.path.join(os.environ["OUT"], "dense_ahead.json")
if os.path.exists(path):
    data = json.load(open(path))
    for r in data if isinstance(data, list) else data.get("results", data.get("placements", [])):
        print(r.get("placement"), "wall", round(r.get("wall_ms", 0), 1), "host compute", round(r.get("host_compute_ms", 0), 1),
              "predicted", round(r.get("predicted_ms", 0), 1))
PY
FIELDS="'placement': '[^']*'|'decode_tok_s': [0-9.]*|'predicted_decode_tok_s': [0-9.]*|'bound_tok_s': [0-9.]*|'decode_worker_team': [0-9]*"
i=0
for ahead in auto off; do
  i=$((i + 1))
  VRAMSHARD_RUN_AHEAD=$ahead timeout 85 python3 -m benchmarks.moe_bench --budgets 8 --batches 1 --time-limit 65 \
    --no-skewed --decode-steps 48 --placements planned,experts-cpu --profile "$PROFILE" \
    --out $OUT/moe_ahead_${ahead}_$i.json > $OUT/moe_ahead_${ahead}_$i.log 2>&1
  echo "run-ahead $ahead rc $? load $(cut -d' ' -f1-3 /proc/loadavg)"
  grep -oE "$FIELDS" $OUT/moe_ahead_${ahead}_$i.log | tr '\n' ' ' | sed 's/.placement/\n&/g'; echo
done
