# ~9.5 min: whole-part re-runs of the report on unchanged measuring code (issue 11's reproducibility):
# Table 4 qwen3-30b-a3b at 12/16 GiB (dense-qwen3moe-c) and Table 9's 16 GiB row, both last run at
# 4c37df8, with the same command and stored profile. The sources' content hash goes to
# $OUT/source.txt, so "same source" does not rest on the device's copy of .git alone.
source benchmarks/gpu_session/setup.sh || exit 1
PROFILE=${PROFILE:-docs/profiles/h200-run15.json}
{ git rev-parse HEAD; git status --short src benchmarks/report; find src benchmarks/report -name '*.py' | sort | xargs sha256sum | sha256sum; } > $OUT/source.txt 2>&1
timeout 320 python3 -m benchmarks.report --part dense-qwen3moe-c --profile $PROFILE --out $OUT > $OUT/report-dense-qwen3moe-c.log 2>&1; echo "rc $?"
grep -o "'system': '[a-z:-]*', 'budget_gib': [0-9.]*, 'context': [0-9]*.\{0,60\}'decode_tok_s': [0-9.]*" $OUT/report-dense-qwen3moe-c.log | cut -c1-200
timeout 262 python3 -m benchmarks.report --part batch-qwen3moe --budgets 16 --deadline-s 200 --profile $PROFILE \
  --out $OUT > $OUT/report-batch-16gib.log 2>&1; echo "rc $?"
grep -o "'system': '[a-z:-]*', 'budget_gib': [0-9.]*, 'batch': [0-9]*.\{0,60\}'tok_s': [0-9.]*" $OUT/report-batch-16gib.log
