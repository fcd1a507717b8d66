# ~9 min, right after call_session28a.sh (written 2026-12-05 in session 27): the whole GPU suite (the
# executor now reports the worker's parts), then the share with a smaller OpenMP team on the worker
# (--threads 12: the host thread, the copier and the driver's threads share the 16 cores with it).
source benchmarks/gpu_session/setup.sh || exit 1
timeout 310 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=10 > $OUT/pytest_gpu.txt 2>&1; tail -3 $OUT/pytest_gpu.txt
grep -E "^(FAILED|ERROR)" $OUT/pytest_gpu.txt | cut -c1-250
VRAMSHARD_RUN_AHEAD=on timeout 230 python3 -m benchmarks.moe_bench --budgets 8 --batches 1 --time-limit 210 --no-skewed \
  --threads 12 --placements experts-zero-copy,planned,experts-zero-copy-cpu@0.5 --shares 0.5 \
  --profile docs/profiles/h200-run26b.json --out $OUT/moe_threads12.json > $OUT/moe_threads12.log 2>&1; echo "moe rc $?"
grep -oE "'placement': '[^']*'|'decode_tok_s': [0-9.]*|'decode_step_ms': [0-9.]*|'decode_host_compute_ms': [0-9.]*|'decode_worker_longest_part_ms': [0-9.]*|'decode_worker_expert_kernel_ms': [0-9.]*" \
  $OUT/moe_threads12.log | tr '\n' ' ' | sed 's/.placement/\n&/g'
