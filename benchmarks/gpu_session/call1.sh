# ~8.5 min on a fresh machine (batch budgets from BUDGETS, default 16, after the twentieth session;
# the plan below was written after the nineteenth): the GPU tests (the
# expert cache filled at load and the cached kernel path of 5-64-token steps have not run on a GPU),
# then the report's batch grid at 2 and 8 GiB again, from the same profile: batch 1 decodes from a
# cache filled at load (80 ms a step in the nineteenth, on a cache that filled one step in eight),
# batches 16 and 64 take the new cached kernel path (1155 and 1484 ms a step at 8 GiB in the
# nineteenth), and batch 64 at 2 GiB is planned for its KV cache (refused in the nineteenth).
# Bring $OUT/report-batch-qwen3moe.json back into docs/runs/<date>-batch-qwen3moe-2-8gib/ and merge:
# a re-run of a few cells replaces only those cells.
source benchmarks/gpu_session/setup.sh || exit 1
PROFILE=${PROFILE:-docs/profiles/h200-run15.json}
timeout 270 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=10 > $OUT/pytest_gpu.txt 2>&1; tail -3 $OUT/pytest_gpu.txt
grep -E "^(FAILED|ERROR)" $OUT/pytest_gpu.txt | cut -c1-250
timeout 290 python3 -m benchmarks.report --part batch-qwen3moe --budgets ${BUDGETS:-16} --deadline-s 230 --profile $PROFILE \
  --out $OUT > $OUT/report-batch-${BUDGETS:-16}gib.log 2>&1; echo "rc $?"
grep -o "'system': '[a-z:-]*', 'budget_gib': [0-9.]*, 'batch': [0-9]*.\{0,60\}'tok_s': [0-9.]*" $OUT/report-batch-${BUDGETS:-16}gib.log
