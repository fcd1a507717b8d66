# ~8.5 min (written 2026-12-06 in session 39). PROFILE=: the profile call_session39d.sh made (kept in docs/profiles).
# 1. qwen3-30b-a3b at 8 GiB, run-ahead on: planned and experts-cpu with that profile (the planner should now choose
#    experts-cpu or better at tier 1; the thirty-fourth session's planned cells decoded at 15.0-16.9 tok/s against
#    19.1-21.8 for experts-cpu), then experts-cpu with the worker's spin off (VRAMSHARD_RUN_AHEAD_SPIN_US=0).
# 2. llama3-8b and nemo-8b at 2 GiB, batch 1, two runs: the drift floor from the model's dtype (decode lost to
#    layers:max, 0.97x and 0.92x, in the thirty-fourth session).
source benchmarks/gpu_session/setup.sh || exit 1
rm -f $OUT/commit.txt $OUT/machine.txt
FIELDS="'placement': '[^']*'|'decode_tok_s': [0-9.]*|'predicted_decode_tok_s': [0-9.]*|'bound_tok_s': [0-9.]*|'decode_step_ms': [0-9.]*|'decode_host_compute_ms': [0-9.]*|'decode_host_wait_ms': [0-9.]*|'decode_worker_expert_kernel_ms': [0-9.]*|'decode_worker_idle_ms': [0-9.]*|'decode_host_buffer_wait_ms': [0-9.]*"
VRAMSHARD_RUN_AHEAD=on timeout 170 python3 -m benchmarks.moe_bench --budgets 8 --batches 1 --time-limit 150 --no-skewed \
  --placements planned,experts-cpu --profile "$PROFILE" --out $OUT/moe_new_profile.json > /tmp/moe1.log 2>&1
echo "moe rc $?"; grep -oE "$FIELDS|'name': '[^']*'" /tmp/moe1.log | tr '\n' ' ' | sed 's/.placement/\n&/g'; echo
VRAMSHARD_RUN_AHEAD_SPIN_US=0 VRAMSHARD_RUN_AHEAD=on timeout 110 python3 -m benchmarks.moe_bench --budgets 8 --batches 1 \
  --time-limit 90 --no-skewed --placements experts-cpu --profile "$PROFILE" --out $OUT/moe_no_spin.json > /tmp/moe2.log 2>&1
echo "moe (no spin) rc $?"; grep -oE "$FIELDS" /tmp/moe2.log | tr '\n' ' ' | sed 's/.placement/\n&/g'; echo
engine_step two 230 --models llama3-8b,nemo-8b --budgets 2 --batch-sizes 1 --repeat 2 --deadline-s 190 --run-limit-s 8
grep -E "planning with" $OUT/two.log | head -2 | cut -c25-250
