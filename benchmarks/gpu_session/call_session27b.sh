# ~9.5 min, after call_session27a.sh (rewritten 2026-12-05 in session 27, after 27a ran alone on its
# machine): the whole GPU suite (the planner's share, the worker's profile rate and the kernels' GIL
# mode are new since it last ran), then MoE decode at 8 GiB with the run-ahead worker's compiled
# kernels leaving the GIL (release, as in 27a) and keeping it (hold), each cell in both modes one
# after the other: in 27a the worker's share of a layer took ~1 ms for 3 or 4 experts (a fixed cost),
# where the pass alone takes 0.3-0.4 ms. Then compiled_gil with both modes (27a's 40 s were too few).
# Ran once, on 7f94a41 (docs/BENCHMARKS.md, "Twenty-fifth GPU session"): the hold mode decoded 1.5-1.9x
# slower and was removed after it, with --worker-kernels; run it on that commit to repeat it.
source benchmarks/gpu_session/setup.sh || exit 1
timeout 310 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=10 > $OUT/pytest_gpu.txt 2>&1; tail -3 $OUT/pytest_gpu.txt
grep -E "^(FAILED|ERROR)" $OUT/pytest_gpu.txt | cut -c1-250
VRAMSHARD_RUN_AHEAD=on timeout 190 python3 -m benchmarks.moe_bench --budgets 8 --batches 1 --time-limit 175 \
  --no-skewed --placements experts-zero-copy,planned,experts-zero-copy-cpu@0.5 --shares 0.5 --worker-kernels release,hold \
  --profile docs/profiles/h200-run26b.json --out $OUT/moe_kernels.json > $OUT/moe_kernels.log 2>&1; echo "moe rc $?"
grep -oE "'placement': '[^']*'|'worker_kernels': '[a-z]*'|'zero_copy_cpu_share': [0-9.]*|'decode_tok_s': [0-9.]*|'predicted_decode_tok_s': [0-9.]*|'decode_step_ms': [0-9.]*|'decode_host_compute_ms': [0-9.]*|'decode_host_wait_ms': [0-9.]*" \
  $OUT/moe_kernels.log | tr '\n' ' ' | sed 's/.placement/\n&/g'
timeout 80 python3 -m benchmarks.compiled_gil --repeats 10 --json $OUT/compiled_gil.json > $OUT/compiled_gil.log 2>&1; echo "rc $?"
tail -3 $OUT/compiled_gil.log | cut -c1-240
