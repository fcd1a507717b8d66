# ~9.5 min (written 2026-12-06 in session 38, which got no machine for its first hour). Sessions 37 and 38 on a GPU
# in one call, most needed first:
# 1. The whole GPU suite (session 37 changed four tests' expectations; neither session's changes have run on a GPU).
# 2. llama3-8b at 8 GiB, batch 1 and 64, every step logged: the planning process at the idle scheduling class, the
#    row-major down copies made when the plans are taken (no step but the first few should pass 300 ms).
# 3. The routed experts' down rows shared evenly over the team (session 38) at the worker's 15 threads and at 16:
#    needs the untracked .kernel-before-shares.c (`git show 0b94414:src/vramshard/layers/cpu_gemv.c`), carried.
# 4. The C kernel without its prefetch against with it (bf16 dense products 8-10% slower with it on the H100 host).
source benchmarks/gpu_session/setup.sh || exit 1
timeout 230 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=10 > $OUT/pytest_gpu.txt 2>&1; echo "suite rc $?"
tail -3 $OUT/pytest_gpu.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest_gpu.txt | cut -c1-250
engine_step llama8 160 --models llama3-8b --budgets 8 --batch-sizes 1,64 --repeat 2 --deadline-s 130 --run-limit-s 8 \
  --log-steps
grep -E "planning process|reconfigured|copied .* row-major|step: .*, [0-9]{3,}\.[0-9] ms:" $OUT/llama8.log | cut -c1-170 | head -20
for THREADS in 15 16; do
  timeout 40 python3 -m benchmarks.kernel_revisions --against .kernel-before-shares.c --experts-only --threads $THREADS \
    --json $OUT/kernel_shares_$THREADS.json > $OUT/kernel_shares_$THREADS.log 2>&1; echo "kernel shares ($THREADS) rc $?"
  grep -v INFO $OUT/kernel_shares_$THREADS.log | tail -4
done
{ echo '#define VS_PREFETCH_ROWS 0'; cat src/vramshard/layers/cpu_gemv.c; } > $OUT/cpu_gemv_no_prefetch.c
timeout 100 python3 -m benchmarks.kernel_revisions --against $OUT/cpu_gemv_no_prefetch.c --rows 1,4 \
  --json $OUT/kernel_prefetch.json > $OUT/kernel_prefetch.log 2>&1; echo "kernel_revisions rc $?"
grep -v INFO $OUT/kernel_prefetch.log | tail -12
