# ~9 min (written 2026-12-06 in session 43). Session 43's changes, never run on a GPU: the steps spare the
# planning process a core while it plans (the thirty-eighth session's calibration plan never came back beside
# steps on all 16 cores), the load is read while a plan is awaited, and read as the cores the work beside
# wants (host_load.wanted_beside). The GPU suite, then llama3-8b at 8 GiB decoding beside 6 burner processes
# with the load following on and off, each engine first settled on its fits' plans (benchmarks/load_beside.py).
# Look for "VRAM budget (calibrate)" within seconds of each fit, "computing on N CPU threads" in the first
# engine's burning phase, and both engines' plan_settled.
source benchmarks/gpu_session/setup.sh || exit 1
rm -f $OUT/commit.txt
gpu_suite ${SUITE_SECONDS:-240}
timeout ${LOAD_SECONDS:-340} python3 -m benchmarks.load_beside --shape llama3-8b --budget 8 --burn ${BURN:-6} \
  --phase-s 30 --settle-s 20 --profile "$PROFILE" --out $OUT/load_beside.json > $OUT/load_beside.log 2>&1
echo "load_beside rc $? load $(cut -d' ' -f1-3 /proc/loadavg)"
grep -E "cores busy beside|following (True|False)|VRAM budget \(|fitted" $OUT/load_beside.log | cut -c1-260
