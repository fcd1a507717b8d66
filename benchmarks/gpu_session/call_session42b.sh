# ~8 min (written 2026-12-06 in session 42). Session 42's load following (runtime/host_load.py: on a lasting
# change of the cores other work keeps busy, the engine computes on the cores left, plans again at that many
# threads and judges its CPU work again), never run on a GPU: the GPU suite, then llama3-8b at 8 GiB decoding
# beside 6 burner processes with the following on and off (benchmarks/load_beside.py, 30-s phases: quiet,
# burning, quiet again). Look for "computing on 10 CPU threads" in the log and the burning phase's tok/s.
source benchmarks/gpu_session/setup.sh || exit 1
rm -f $OUT/commit.txt
gpu_suite ${SUITE_SECONDS:-240}
timeout ${LOAD_SECONDS:-330} python3 -m benchmarks.load_beside --shape llama3-8b --budget 8 --burn ${BURN:-6} \
  --phase-s 30 --profile "$PROFILE" --out $OUT/load_beside.json > $OUT/load_beside.log 2>&1
echo "load_beside rc $? load $(cut -d' ' -f1-3 /proc/loadavg)"
grep -E "cores busy beside|following (True|False)" $OUT/load_beside.log | cut -c1-260
