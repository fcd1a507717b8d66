# ~6 min (written 2026-12-06 in session 39). qwen3-30b-a3b at 8 GiB, decode at 1K context, run-ahead on: who waits
# for whom in an experts-cpu step. In the thirty-second session its 66.8 ms step held 50.4 ms of the worker's
# computing and 0.7 ms of its waits for the GPU: the rest (~16 ms) was the worker waiting for the host thread's next
# part, or the host thread waiting for a result buffer. The cells now report both (decode_worker_idle_ms,
# decode_host_buffer_wait_ms). Then the same with the experts kernel's team spinning through the pauses.
source benchmarks/gpu_session/setup.sh || exit 1
FIELDS="'placement': '[^']*'|'decode_tok_s': [0-9.]*|'predicted_decode_tok_s': [0-9.]*|'bound_tok_s': [0-9.]*|'decode_step_ms': [0-9.]*|'decode_host_compute_ms': [0-9.]*|'decode_host_wait_ms': [0-9.]*|'decode_worker_expert_kernel_ms': [0-9.]*|'decode_worker_idle_ms': [0-9.]*|'decode_host_buffer_wait_ms': [0-9.]*"
VRAMSHARD_RUN_AHEAD=on timeout 200 python3 -m benchmarks.moe_bench --budgets 8 --batches 1 --time-limit 180 --no-skewed \
  --placements experts-cpu,planned,experts-zero-copy-cpu --profile "$PROFILE" --out $OUT/moe_who_waits.json \
  > /tmp/moe_who_waits.log 2>&1
echo "moe rc $?"; grep -oE "$FIELDS" /tmp/moe_who_waits.log | tr '\n' ' ' | sed 's/.placement/\n&/g'; echo
GOMP_SPINCOUNT=20000000 VRAMSHARD_RUN_AHEAD=on timeout 110 python3 -m benchmarks.moe_bench --budgets 8 --batches 1 \
  --time-limit 90 --no-skewed --placements experts-cpu --profile "$PROFILE" --out $OUT/moe_spin.json \
  > /tmp/moe_spin.log 2>&1
echo "moe (GOMP_SPINCOUNT) rc $?"; grep -oE "$FIELDS" /tmp/moe_spin.log | tr '\n' ' ' | sed 's/.placement/\n&/g'; echo
grep -E "Traceback|Error" /tmp/moe_who_waits.log /tmp/moe_spin.log | head -5
cat $OUT/commit.txt $OUT/machine.txt; rm -f $OUT/commit.txt $OUT/machine.txt
