# ~9 min on a fresh machine: the GPU tests (320 s: since session 25 engines also compile the CPU's
# SwiGLU and one-token expert kernels at load), then the report's batch grid at the budgets in BUDGETS
# (GiB, comma-separated; default 16, the row the twentieth session did not re-run), from the stored
# profile. Bring $OUT/report-batch-qwen3moe.json back into docs/runs/<date>-batch-qwen3moe-<budgets>gib/
# and merge: a re-run of a few cells replaces only those cells.
source benchmarks/gpu_session/setup.sh || exit 1
PROFILE=${PROFILE:-docs/profiles/h200-run15.json}
timeout 320 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=10 > $OUT/pytest_gpu.txt 2>&1; tail -3 $OUT/pytest_gpu.txt
grep -E "^(FAILED|ERROR)" $OUT/pytest_gpu.txt | cut -c1-250
timeout 245 python3 -m benchmarks.report --part batch-qwen3moe --budgets ${BUDGETS:-16} --deadline-s 185 --profile $PROFILE \
  --out $OUT > $OUT/report-batch-${BUDGETS:-16}gib.log 2>&1; echo "rc $?"
grep -o "'system': '[a-z:-]*', 'budget_gib': [0-9.]*, 'batch': [0-9]*.\{0,60\}'tok_s': [0-9.]*" $OUT/report-batch-${BUDGETS:-16}gib.log
