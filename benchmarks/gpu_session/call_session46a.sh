# ~9.5 min (written 2026-12-06 in session 46). The Profiler issue's repeatability: two full profiles of this
# machine in one process (benchmarks/profile_check.py; a full profile took 234 s on the H100 in session 40, so
# both fit the budget; where the first takes over half of it, the second is a quick one and the output says so).
# Give the whole call to it: nothing else runs.
source benchmarks/gpu_session/setup.sh || exit 1
timeout ${PROFILE_S:-585} python3 benchmarks/profile_check.py --budget-s ${BUDGET_S:-540} --out $OUT/profile_check.json \
  > $OUT/profile_check.log 2>&1
echo "profile_check rc $?"
tail -45 $OUT/profile_check.log
