# ~7 min: the profile check's second half (Profiler issue): a second full profile on the same
# machine, compared with the first (call 2's profile_run1.json, copied to FIRST, default
# docs/profiles/h200-run17.json), and the held-out shapes against the second.
source benchmarks/gpu_session/setup.sh || exit 1
FIRST=${FIRST:-docs/profiles/h200-run17.json}
timeout 590 python3 benchmarks/profile_check.py --against $FIRST --out $OUT/profile_check_against.json \
  > $OUT/profile_check_against.log 2>&1; echo "rc $?"
grep -E "^profile runs|peak|GB/s|dispatch|within 20%|cpu drift|total|Error" $OUT/profile_check_against.log | cut -c1-200
