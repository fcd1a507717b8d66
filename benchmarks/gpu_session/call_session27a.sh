# ~5 min on a FRESH machine (written 2026-12-05 in session 26): why did the CPU's share of the zero-copy
# experts decode 4-5x slower in the twenty-fourth session (2.99 and 3.98 tok/s) than in the twenty-third
# (15.32)? The twenty-fourth ran it after the GPU tests and a killed profile, the twenty-third first on
# its boot. This runs it first, planned from the profile with the worker's rate (h200-run26b.json), with
# each cell's last decode step recorded (the worker's computing and waiting) and the compiled kernels
# that exist; then compiled_gil (the worker's pass beside Python). call_session27b.sh runs the same after
# the GPU suite, on the same machine: fire it within 30 s of this call's return.
source benchmarks/gpu_session/setup.sh || exit 1
VRAMSHARD_RUN_AHEAD=on timeout 240 python3 -m benchmarks.moe_bench --budgets 8 --batches 1 --time-limit 220 \
  --no-skewed --placements experts-zero-copy,experts-zero-copy-cpu@0.5,experts-zero-copy-cpu@0.375,planned --shares 0.5,0.375 --profile docs/profiles/h200-run26b.json \
  --out $OUT/moe_first.json > $OUT/moe_first.log 2>&1; echo "moe rc $?"
grep -oE "'placement': '[^']*'|'zero_copy_cpu_share': [0-9.]*|'decode_tok_s': [0-9.]*|'decode_step_ms': [0-9.]*|'decode_host_compute_ms': [0-9.]*|'decode_host_wait_ms': [0-9.]*" \
  $OUT/moe_first.log | tr '\n' ' ' | sed 's/.placement/\n&/g'
timeout 40 python3 -m benchmarks.compiled_gil --json $OUT/compiled_gil.json > $OUT/compiled_gil.log 2>&1; echo "rc $?"
tail -2 $OUT/compiled_gil.log | cut -c1-240
