# ~9.5 min (written 2026-12-06 in session 39, which lost most of its device time to failed starts): the most needed
# parts of call_session39a.sh and 39b.sh in one call.
# 1. The whole GPU suite (sessions 37-38 changed GPU code; session 38's profile table and drift floor not yet run).
# 2. qwen3-30b-a3b at 8 GiB, experts-cpu and planned, run-ahead on: who waits for whom (decode_worker_idle_ms:
#    the worker waiting for the host thread's next part; decode_host_buffer_wait_ms: the host thread two parts ahead).
# 3. llama3-8b at 8 GiB, batch 1 and 64, every step logged (the drift line should say x0.95 or nothing).
source benchmarks/gpu_session/setup.sh || exit 1
gpu_suite 230
FIELDS="'placement': '[^']*'|'decode_tok_s': [0-9.]*|'predicted_decode_tok_s': [0-9.]*|'bound_tok_s': [0-9.]*|'decode_step_ms': [0-9.]*|'decode_host_compute_ms': [0-9.]*|'decode_host_wait_ms': [0-9.]*|'decode_worker_expert_kernel_ms': [0-9.]*|'decode_worker_idle_ms': [0-9.]*|'decode_host_buffer_wait_ms': [0-9.]*"
VRAMSHARD_RUN_AHEAD=on timeout 170 python3 -m benchmarks.moe_bench --budgets 8 --batches 1 --time-limit 150 --no-skewed \
  --placements experts-cpu,planned --profile "$PROFILE" --out $OUT/moe_who_waits.json > /tmp/moe_who_waits.log 2>&1
echo "moe rc $?"; grep -oE "$FIELDS" /tmp/moe_who_waits.log | tr '\n' ' ' | sed 's/.placement/\n&/g'; echo
grep -E "Traceback|Error" /tmp/moe_who_waits.log | head -5
engine_step llama8 140 --models llama3-8b --budgets 8 --batch-sizes 1,64 --repeat 1 --deadline-s 110 --run-limit-s 8 \
  --log-steps
grep -E "planning process|reconfigured|drift|going back|step: .*, [0-9]{3,}\.[0-9] ms:" $OUT/llama8.log | cut -c1-170 | head -20
cat $OUT/commit.txt $OUT/machine.txt; rm -f $OUT/commit.txt $OUT/machine.txt
