# ~4.5 min (written 2026-12-03 after the nineteenth session; with the device time left): the CPU's
# one-token projections over 2 GiB walks of pageable and pinned weights beside the profile's own way
# of timing the same projection (benchmarks/pinned_cpu_read.py, profile_over_pageable): is the
# engine's in-run CPU factor of ~1.4-1.6 the profile's ring of 512 MiB reading faster than a model?
source benchmarks/gpu_session/setup.sh || exit 1
timeout 140 python3 -m benchmarks.pinned_cpu_read --gib 2 --passes 4 --json $OUT/pinned_cpu_read.json \
  > $OUT/pinned_cpu_read.log 2>&1; echo "rc $?"
grep "GB/s" $OUT/pinned_cpu_read.log | cut -c1-300
# The report's nemo-8b 16 GiB / 4K cell with every engine on one CPU thread: the planned engine and
# layers:40 run the same placement there, but on 1 and 16 threads, and the nineteenth session
# measured 13.4 against 20.4 ms. Kept out of docs/runs (the engines are not run as users get them).
mkdir -p $OUT/threads1
OMP_NUM_THREADS=1 timeout 150 python3 -m benchmarks.report --part dense-nemo-b --budgets 16 --contexts 4096 \
  --profile docs/profiles/h200-run15.json --out $OUT/threads1 > $OUT/threads1/report.log 2>&1; echo "rc $?"
grep -o "'system': '[a-z:]*', 'budget_gib': [0-9.]*, 'context': [0-9]*, 'placement': '[^']*'.\{0,80\}decode_step_ms': [0-9.]*" $OUT/threads1/report.log
