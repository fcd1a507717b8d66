# ~3 min (eighteenth session, with the device time left): does the CPU read pinned host weights
# slower than pageable ones (benchmarks/pinned_cpu_read.py)? Then the report's 16 GiB / 4K nemo-8b
# cell again with the planner that pins instead of streaming through slots (planner.py,
# _unstreamed_variant): 41.4 ms per step before, against 18.3 ms for layers:40.
source benchmarks/gpu_session/setup.sh || exit 1
timeout 90 python3 -m benchmarks.pinned_cpu_read --json $OUT/pinned_cpu_read.json > $OUT/pinned_cpu_read.log 2>&1; echo "rc $?"
tail -4 $OUT/pinned_cpu_read.log | cut -c1-300
timeout 150 python3 -m benchmarks.report --part dense-nemo-b --budgets 16 --contexts 4096 \
  --profile docs/profiles/h200-run15.json --out $OUT > $OUT/report-16gib-4k.log 2>&1; echo "rc $?"
grep -o "'system': '[a-z:]*', 'budget_gib': [0-9.]*, 'context': [0-9]*, 'placement': '[^']*', 'resident_gib': [0-9.]*, 'vram_plan_gib': [0-9.]*, 'decode_step_ms': [0-9.]*" $OUT/report-16gib-4k.log
