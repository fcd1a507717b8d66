# ~4 min (written 2026-12-06 in session 41). The host thread's OpenMP team in split dense steps (run-ahead off,
# the default): llama3-8b's planned one-token step at 8 and 2 GiB with 16, 14 and 12 CPU threads, twice, in one
# process (benchmarks.step_profile, planned:G@T). Split FFNs' CPU parts have run 1.2-1.7x their prediction inside
# GPU steps since the fifteenth session; the run-ahead worker's team of 15 collapsed in 4 of 8 runs on the
# thirty-sixth session's busy host while teams of 12-14 never did. If 14 or 12 threads beat 16 here, the host
# thread's team wants the same tuning as the worker's (runtime/team_tuner.py).
source benchmarks/gpu_session/setup.sh || exit 1
rm -f $OUT/commit.txt
PLACEMENTS=planned:8@16,planned:8@14,planned:8@12,planned:8@16,planned:8@14,planned:8@12
PLACEMENTS=$PLACEMENTS,planned:2@16,planned:2@14,planned:2@12,planned:2@16,planned:2@14,planned:2@12
timeout ${SECONDS_LIMIT:-280} python3 -m benchmarks.step_profile --shape llama3-8b --placements $PLACEMENTS \
  --profile "$PROFILE" --steps 30 --warmup 20 --rows 5 --json $OUT/host_threads.json > $OUT/host_threads.log 2>&1
echo "step_profile rc $? load $(cut -d' ' -f1-3 /proc/loadavg)"
step_summary $OUT/host_threads.json
