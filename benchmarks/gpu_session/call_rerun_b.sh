# ~9 min: a whole-part re-run of Table 4 qwen3-30b-a3b at 6/8 GiB (dense-qwen3moe-b, last run at
# 4c37df8) on unchanged measuring code, then benchmarks.cpu_read_method (which of ring size,
# statistic or fresh clones makes the profile's CPU projection read faster than a model walk).
source benchmarks/gpu_session/setup.sh || exit 1
PROFILE=${PROFILE:-docs/profiles/h200-run15.json}
{ git rev-parse HEAD; git status --short src benchmarks; lscpu | grep -E "Model name|MHz|L3|NUMA node0|Thread"; \
  nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu --format=csv; } >> $OUT/machine.txt 2>&1
timeout 410 python3 -m benchmarks.report --part dense-qwen3moe-b --profile $PROFILE --out $OUT > $OUT/report-dense-qwen3moe-b.log 2>&1; echo "rc $?"
grep -o "'system': '[a-z:-]*', 'budget_gib': [0-9.]*, 'context': [0-9]*.\{0,60\}'decode_tok_s': [0-9.]*" $OUT/report-dense-qwen3moe-b.log | cut -c1-200
timeout 150 python3 -m benchmarks.cpu_read_method --json $OUT/cpu_read_method.json > $OUT/cpu_read_method.log 2>&1; echo "rc $?"
tail -12 $OUT/cpu_read_method.log | cut -c1-200
