# ~2.5 min (written 2026-12-03 after the nineteenth session; with the device time left): the CPU's
# one-token projections over 2 GiB walks of pageable and pinned weights beside the profile's own way
# of timing the same projection (benchmarks/pinned_cpu_read.py, profile_over_pageable): is the
# engine's in-run CPU factor of ~1.4-1.6 the profile's ring of 512 MiB reading faster than a model?
source benchmarks/gpu_session/setup.sh || exit 1
timeout 140 python3 -m benchmarks.pinned_cpu_read --gib 2 --passes 4 --json $OUT/pinned_cpu_read.json \
  > $OUT/pinned_cpu_read.log 2>&1; echo "rc $?"
grep "GB/s" $OUT/pinned_cpu_read.log | cut -c1-300
