# ~9 min, fired within 30 s of call_session26a.sh's return (same machine): the Profiler issue's check
# against that call's full profile (docs/profiles/h200-run26.json): a second full profile, the main
# figures of the two compared, the held-out shapes against the second. Keep $OUT/profile_check.json
# as docs/results-profile-check-run26.json and profile_run2.json as docs/profiles/h200-run26b.json.
source benchmarks/gpu_session/setup.sh || exit 1
timeout 585 python3 benchmarks/profile_check.py --against ${AGAINST:-docs/profiles/h200-run26.json} \
  > $OUT/profile_check.log 2>&1; echo "rc $?"
tail -45 $OUT/profile_check.log | cut -c1-200
