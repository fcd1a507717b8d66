# ~8 min: the profile check's first half (Profiler issue): one full profile (309 s in the fifteenth
# session), a quick one, and the held-out shapes against the full one. Bring $OUT/profile_run1.json
# back into docs/profiles/ (e.g. h200-run17.json) before call 3, which measures a second full
# profile and compares the two.
source benchmarks/gpu_session/setup.sh || exit 1
timeout 590 python3 benchmarks/profile_check.py --second-quick --budget-s 570 --out $OUT/profile_check.json \
  > $OUT/profile_check.log 2>&1; echo "rc $?"
grep -E "^profile runs|peak|GB/s|dispatch|within 20%|cpu drift|total" $OUT/profile_check.log | cut -c1-200
