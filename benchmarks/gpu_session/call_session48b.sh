# ~7 min (written 2026-12-06 in session 48). The second full profile, compared with call_session48a.sh's first,
# which must still be on this machine (build/profile_a.json: fire this call right after that one returns); then
# the held-out shapes against the second (benchmarks/profile_check.py --against).
source benchmarks/gpu_session/setup.sh || exit 1
test -s build/profile_a.json || { echo "build/profile_a.json is gone: a fresh machine; run call_session48a.sh first"; exit 1; }
timeout ${PROFILE_S:-585} python3 benchmarks/profile_check.py --against build/profile_a.json \
  --out $OUT/profile_check.json > $OUT/profile_check.log 2>&1
echo "profile_check rc $?"
tail -45 $OUT/profile_check.log
