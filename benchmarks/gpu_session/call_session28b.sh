# ~9.5 min, fired within 30 s of call_session28a.sh's return (the same boot), after its profile was
# copied to docs/profiles/h200-run28a.json (written 2026-12-05 in session 28): the Profiler issue's
# same-boot repeatability (a second full profile, the main figures of the two compared) and the held-out
# shapes against the second. Keep $OUT/profile_check.json as docs/results-profile-check-run28.json and
# $OUT/profile_run2.json as docs/profiles/h200-run28b.json.
source benchmarks/gpu_session/setup.sh || exit 1
timeout 585 python3 benchmarks/profile_check.py --against ${AGAINST:-docs/profiles/h200-run28a.json} \
  > $OUT/profile_check.log 2>&1; echo "rc $?"
tail -45 $OUT/profile_check.log | cut -c1-200
