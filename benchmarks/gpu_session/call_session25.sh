# ~6 min (written 2026-12-05 in session 25, which had no GPU): what session 25 changed, on the H200.
# 1. MoE run-ahead: the CPU's share of each layer's experts on the worker, now one compiled call a
#    layer (it took the GIL back 23-24 times a layer before, 2-6 now, on the development machine).
#    The sixteenth session, with the old pass: 12.64 (kernels alone) against 9.42 tok/s (with the share).
# 2. What a GIL take costs on this host: a token's routed-expert pass and dense FFN parts, alone and
#    on a worker beside a thread running Python (benchmarks/compiled_gil, benchmarks/cpu_swiglu).
# Bring the JSON files back into docs/ (results-*-run<N>.json) and add a section to docs/BENCHMARKS.md.
source benchmarks/gpu_session/setup.sh || exit 1
PROFILE=${PROFILE:-docs/profiles/h200-run15.json}
VRAMSHARD_RUN_AHEAD=on timeout 200 python3 -m benchmarks.moe_bench --budgets 8 --batches 1 --time-limit 150 \
  --placements experts-zero-copy,experts-zero-copy-cpu --profile $PROFILE --out $OUT/moe_run_ahead.json \
  > $OUT/moe_run_ahead.log 2>&1; echo "rc $?"
grep -iE "tok/s|error" $OUT/moe_run_ahead.log | tail -8 | cut -c1-240
timeout 40 python3 -m benchmarks.compiled_gil --json $OUT/compiled_gil.json > $OUT/compiled_gil.log 2>&1; echo "rc $?"
tail -2 $OUT/compiled_gil.log | cut -c1-240
timeout 100 python3 -m benchmarks.cpu_swiglu --rows 1,64 --repeats 9 --json $OUT/cpu_swiglu.json > $OUT/cpu_swiglu.log 2>&1; echo "rc $?"
grep "rows': 1," $OUT/cpu_swiglu.log | cut -c1-400
