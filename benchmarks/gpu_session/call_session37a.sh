# ~6.5 min (written 2026-12-05 in session 37, after the thirty-second GPU session). Session 37's fixes on a GPU:
# 1. The GPU tests that failed in that session's suite run (their expectations predated packing only where the
#    plan packs), and the planning process's tests.
# 2. llama3-8b at 8 GiB, batch 1 and 64, every step logged: the planning process now runs at the idle scheduling
#    class (at normal priority its core slowed decode steps 2-5x while a calibration's plan was made), and each
#    FFN's row-major down copy is made when the plans are taken by the C library's transpose (torch's took
#    0.9-1.2 s in each tier's first step). No step but the first few should pass 300 ms.
# 3. The row-major down copy on this host: the library's transpose against torch's one-thread copy and a plain copy.
# 4. The C kernel without its prefetch against with it: on this host session 36's prefetch made bf16 dense one-row
#    products 8-9% slower (fp16 and the routed experts faster).
source benchmarks/gpu_session/setup.sh || exit 1
timeout 90 python3 -m pytest -q -rs -p no:cacheprovider tests/test_plan_process.py tests/test_cpu_down.py \
  "tests/test_executor_gpu.py::test_split_ffn_placement_matches_cpu_float32" \
  "tests/test_executor_gpu.py::test_split_ffn_one_row_parts_by_the_c_kernel_match_cpu_float32" \
  > $OUT/pytest_fixed.txt 2>&1; echo "tests rc $?"; tail -2 $OUT/pytest_fixed.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest_fixed.txt
engine_step llama8 200 --models llama3-8b --budgets 8 --batch-sizes 1,64 \
  --repeat 2 --deadline-s 170 --run-limit-s 8 --log-steps
grep -E "planning process|reconfigured|copied .* row-major|step: .*, [0-9]{3,}\.[0-9] ms:" $OUT/llama8.log | cut -c1-170 | head -30
timeout 60 python3 -m benchmarks.down_copy --threads 1,16 --json $OUT/down_copy.json > $OUT/down_copy.log 2>&1
echo "down_copy rc $?"; grep -oE "'part': '[^']*'|'threads': [0-9]+|'[a-z]+_gb_s': [0-9.]+" $OUT/down_copy.log | tr '\n' ' ' | sed "s/'part'/\n&/g"; echo
{ echo '#define VS_PREFETCH_ROWS 0'; cat src/vramshard/layers/cpu_gemv.c; } > $OUT/cpu_gemv_no_prefetch.c
timeout 120 python3 -m benchmarks.kernel_revisions --against $OUT/cpu_gemv_no_prefetch.c --json $OUT/kernel_prefetch.json \
  > $OUT/kernel_prefetch.log 2>&1; echo "kernel_revisions rc $?"; grep -v INFO $OUT/kernel_prefetch.log | tail -14
# 5. (session 38) The routed experts' down rows shared out evenly over the team: the run-ahead worker computes with 15
#    threads, where the earlier kernel's 64 runs of 32 rows left four threads a fifth run. Needs the untracked
#    .kernel-before-shares.c here (`git show 0b94414:src/vramshard/layers/cpu_gemv.c`), carried with the tree.
for THREADS in 15 16; do
  timeout 45 python3 -m benchmarks.kernel_revisions --against .kernel-before-shares.c --experts-only --threads $THREADS \
    --json $OUT/kernel_shares_$THREADS.json > $OUT/kernel_shares_$THREADS.log 2>&1; echo "kernel shares ($THREADS) rc $?"
  grep -v INFO $OUT/kernel_shares_$THREADS.log | tail -4
done
