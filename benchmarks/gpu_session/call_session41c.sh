# ~5 min (written 2026-12-06 in session 41). Whether run-ahead should be on by default for MoE models: qwen3-30b-a3b
# at 8 GiB, planned and experts-cpu, with VRAMSHARD_RUN_AHEAD off (the default: the host thread computes the host
# experts between its launches) and on (the worker does, its team tuned), off/on/off/on in four processes. Every
# MoE figure since the twenty-third session ran with it on; the last A/B is the sixteenth session's (H200).
source benchmarks/gpu_session/setup.sh || exit 1
rm -f $OUT/commit.txt
FIELDS="'placement': '[^']*'|'decode_tok_s': [0-9.]*|'predicted_decode_tok_s': [0-9.]*|'bound_tok_s': [0-9.]*|'decode_step_ms': [0-9.]*|'decode_worker_team': [0-9]*"
i=0
for ahead in off on off on; do
  i=$((i + 1))
  VRAMSHARD_RUN_AHEAD=$ahead timeout 85 python3 -m benchmarks.moe_bench --budgets 8 --batches 1 --time-limit 65 \
    --no-skewed --decode-steps 48 --placements planned,experts-cpu --profile "$PROFILE" \
    --out $OUT/moe_ahead_${ahead}_$i.json > $OUT/moe_ahead_${ahead}_$i.log 2>&1
  echo "run-ahead $ahead rc $? load $(cut -d' ' -f1-3 /proc/loadavg)"
  grep -oE "$FIELDS" $OUT/moe_ahead_${ahead}_$i.log | tr '\n' ' ' | sed 's/.placement/\n&/g'; echo
done
