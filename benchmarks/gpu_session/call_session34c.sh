# ~9.5 min, H200 machine only (written 2026-12-05 in session 33). The Profiler issue's repeatability and held-out
# check against the thirtieth session's full profile (docs/profiles/h200-run33.json, 394 s, same fingerprint):
# a second full profile, the main figures compared, the held-out shapes against it. Keep
# $OUT/profile_check.json as docs/results-profile-check-run34.json.
source benchmarks/gpu_session/setup.sh || exit 1
timeout 585 python3 benchmarks/profile_check.py --against docs/profiles/h200-run33.json --out $OUT/profile_check.json \
  > $OUT/profile_check.log 2>&1; echo "rc $?"
tail -45 $OUT/profile_check.log | cut -c1-200
