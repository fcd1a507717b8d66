# ~7 min on a FRESH machine (written 2026-12-05 in session 27, after the twenty-fifth GPU session). The
# planned MoE share decoded at 15.99 tok/s on one machine and 12.66 on another (kernels alone 12.62 and
# 12.45), and the worker's part of a layer cost ~1 ms for 3 or 4 experts, about 3x the pass alone.
# 1. Three alternating pairs (kernels alone, planned) on one boot, with the worker's parts per step
#    (decode_worker_*: the expert pass's compiled call against the part's whole computing): is the
#    share's gain the machine or the run, and where does the ~1 ms go?
# 2. compiled_gil, given 150 s (40 and 80 s were too few on a fresh machine).
source benchmarks/gpu_session/setup.sh || exit 1
VRAMSHARD_RUN_AHEAD=on timeout 280 python3 -m benchmarks.moe_bench --budgets 8 --batches 1 --time-limit 260 --no-skewed \
  --placements experts-zero-copy,planned,experts-zero-copy,planned,experts-zero-copy,planned \
  --profile docs/profiles/h200-run26b.json --out $OUT/moe_repeats.json > $OUT/moe_repeats.log 2>&1; echo "moe rc $?"
grep -oE "'placement': '[^']*'|'decode_tok_s': [0-9.]*|'decode_step_ms': [0-9.]*|'decode_host_compute_ms': [0-9.]*|'decode_worker_longest_part_ms': [0-9.]*|'decode_worker_expert_kernel_ms': [0-9.]*" \
  $OUT/moe_repeats.log | tr '\n' ' ' | sed 's/.placement/\n&/g'
timeout 150 python3 -m benchmarks.compiled_gil --repeats 10 --json $OUT/compiled_gil.json > $OUT/compiled_gil.log 2>&1; echo "rc $?"
tail -2 $OUT/compiled_gil.log | cut -c1-240
