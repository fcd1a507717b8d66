# ~8 min (written 2026-12-07 in session 60; `timeout_s` 590; right after call_session61a.sh on the same machine).
# The Profiler issue's repeatability: a second full profile against call_session61a.sh's (kept on the machine as
# bench_out/profile-run61a.json) and the held-out shapes (benchmarks/profile_check.py --against), the check now
# printing the cores other processes kept busy and the steal among them beside each CPU probe and for each run.
source benchmarks/gpu_session/setup.sh || exit 1
[ -f bench_out/profile-run61a.json ] || { echo "no bench_out/profile-run61a.json: run call_session61a.sh first";
                                          exit 1; }
timeout ${CHECK_S:-570} python3 benchmarks/profile_check.py --against bench_out/profile-run61a.json --budget-s 540 \
  --out $OUT/profile_check.json > $OUT/profile_check.log 2>&1
echo "check rc $?"; grep -E "probe|other work|peak|h2d|d2h|within 20%|dispatch" $OUT/profile_check.log | cut -c1-300
