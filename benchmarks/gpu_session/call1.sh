# ~8.5 min on a fresh machine (written 2026-12-03 after the nineteenth session): the GPU tests (the
# expert cache filled at load has not run on a GPU), then two cell re-runs of the report from the
# same profile: qwen3-30b-a3b at 16 GiB / 1K (80.9 ms a step in the nineteenth, on a cache that
# filled one decode step in eight), and the batch grid at 2 GiB (batch 64's planned engine was
# refused there: planned for one sequence). Bring each $OUT/report-*.json back into
# docs/runs/<date>-<part>-<cells>/ and merge: a re-run of a few cells replaces only those cells.
source benchmarks/gpu_session/setup.sh || exit 1
PROFILE=${PROFILE:-docs/profiles/h200-run15.json}
timeout 280 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=10 > $OUT/pytest_gpu.txt 2>&1; tail -3 $OUT/pytest_gpu.txt
grep -E "^(FAILED|ERROR)" $OUT/pytest_gpu.txt | cut -c1-250
timeout 140 python3 -m benchmarks.report --part dense-qwen3moe-c --budgets 16 --contexts 1024 --profile $PROFILE \
  --out $OUT > $OUT/report-qwen3moe-16gib-1k.log 2>&1; echo "rc $?"
grep -o "'system': '[a-z:-]*', 'budget_gib': [0-9.]*, 'context': [0-9]*, 'placement': '[^']*'.\{0,120\}decode_step_ms': [0-9.]*" $OUT/report-qwen3moe-16gib-1k.log
grep -o "expert_hit_rate': [0-9.]*" $OUT/report-qwen3moe-16gib-1k.log
timeout 150 python3 -m benchmarks.report --part batch-qwen3moe --budgets 2 --profile $PROFILE --out $OUT \
  > $OUT/report-batch-2gib.log 2>&1; echo "rc $?"
grep -o "'system': '[a-z:-]*', 'budget_gib': [0-9.]*, 'batch': [0-9]*.\{0,60\}'tok_s': [0-9.]*" $OUT/report-batch-2gib.log
