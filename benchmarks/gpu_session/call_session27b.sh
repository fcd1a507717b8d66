# ~9 min, right after call_session27a.sh on the same machine: the whole GPU suite (the planner's share and
# the worker's profile rate are new since it last ran), then the same MoE cells again: does what ran
# before them (tests compiling kernels, the inductor cache) make the CPU's share slow?
source benchmarks/gpu_session/setup.sh || exit 1
timeout 320 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=10 > $OUT/pytest_gpu.txt 2>&1; tail -3 $OUT/pytest_gpu.txt
grep -E "^(FAILED|ERROR)" $OUT/pytest_gpu.txt | cut -c1-250
VRAMSHARD_RUN_AHEAD=on timeout 230 python3 -m benchmarks.moe_bench --budgets 8 --batches 1 --time-limit 210 \
  --no-skewed --placements experts-zero-copy,experts-zero-copy-cpu@0.5,experts-zero-copy-cpu@0.375,planned --shares 0.5,0.375 --profile docs/profiles/h200-run26b.json \
  --out $OUT/moe_after_tests.json > $OUT/moe_after_tests.log 2>&1; echo "moe rc $?"
grep -oE "'placement': '[^']*'|'zero_copy_cpu_share': [0-9.]*|'decode_tok_s': [0-9.]*|'decode_step_ms': [0-9.]*|'decode_host_compute_ms': [0-9.]*|'decode_host_wait_ms': [0-9.]*" \
  $OUT/moe_after_tests.log | tr '\n' ' ' | sed 's/.placement/\n&/g'
