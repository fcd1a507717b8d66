# ~9 min (written 2026-12-06 in session 40). PROFILE=: the machine's profile (setup.sh: h100-run40 on an H100).
# 1. The GPU suite (session 40: a plan's share 1 of the zero-copy experts, all on the worker, not yet run).
# 2. llama3-8b at 8 and 2 GiB, batch 1, two runs each: the planned engine against layers:max on one host, now
#    that steps with CPU path trials are not fitted (the thirty-fifth session's machine A fitted the head's trials
#    to every CPU layer and lost to layers:17, 15.6 against 18.6 tok/s; machines B and C won, 1.10x and 1.13x).
# 3. qwen3-30b-a3b at 8 GiB, run-ahead on: planned (share 1 by default since session 40) against experts-cpu.
source benchmarks/gpu_session/setup.sh || exit 1
rm -f $OUT/commit.txt
gpu_suite 200
engine_step llama8 150 --models llama3-8b --budgets 8 --batch-sizes 1 --repeat 2 --deadline-s 130 --run-limit-s 8
grep -E "fitted|planning with" $OUT/llama8.log | cut -c25-300
engine_step llama2 130 --models llama3-8b --budgets 2 --batch-sizes 1 --repeat 2 --deadline-s 110 --run-limit-s 8
FIELDS="'placement': '[^']*'|'zero_copy_cpu_share': [0-9.]*|'decode_tok_s': [0-9.]*|'predicted_decode_tok_s': [0-9.]*|'bound_tok_s': [0-9.]*|'decode_step_ms': [0-9.]*|'decode_worker_idle_ms': [0-9.]*"
VRAMSHARD_RUN_AHEAD=on timeout 110 python3 -m benchmarks.moe_bench --budgets 8 --batches 1 --time-limit 95 --no-skewed \
  --placements planned,experts-cpu --profile "$PROFILE" --out $OUT/moe.json > /tmp/moe.log 2>&1
echo "moe rc $?"; grep -oE "$FIELDS" /tmp/moe.log | tr '\n' ' ' | sed 's/.placement/\n&/g'; echo
