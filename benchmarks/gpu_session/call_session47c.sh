# ~7 min (written 2026-12-06 in session 47). Whether the dispatch fit helps: llama3-8b at 2 and 8 GiB against
# layers:max with VRAMSHARD_DISPATCH_FIT on, then off (one engine_bench process each, cells long enough for
# the guard against a slower re-plan: 15 s runs). Compare tg and batch 1 of each pair, and in each log the fits
# ("fitted the profile's dispatch_scale", "the dispatch is not fitted") and the plans they led to. Run it twice
# (two calls) for two pairs.
source benchmarks/gpu_session/setup.sh || exit 1
switch_runs VRAMSHARD_DISPATCH_FIT "${DISPATCH_FIT_RUNS:-on off}" dispatch ${STEP_S:-270} --models llama3-8b \
  --budgets 2,8 --batch-sizes 1 --repeat 1 --deadline-s 255 --run-limit-s 15
for log in $OUT/dispatch_*.log; do
  echo "$log"; grep -hoE "dispatch_scale to [0-9.]*|the dispatch is not fitted" "$log" | sort | uniq -c
done
