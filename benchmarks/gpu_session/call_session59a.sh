# ~6 min (written 2026-12-07 in session 59). Session 58's GPU-side fixes (the reconfigure test's later change, the
# graph pricing's tests, the profile's replay timing), then where a planned decode step's host time goes: the
# fifty-third session's planned:8 step took 84 ms where its copies (52) and CPU work (47) should overlap (priced 46),
# with the host waiting 0.9 ms of it, so the host thread was busy the whole step. cProfile by Python function
# (--pystats) and a chrome trace, with the link codec on and off (its fills go in ~12 rounds each, each round a
# copy and a Triton decode issued from the host thread), and with the VRAM codec on.
source benchmarks/gpu_session/setup.sh || exit 1
timeout ${TESTS_S:-150} python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider tests/test_budget.py \
  tests/test_estimator_graphs.py tests/test_profile.py::test_gpu_profile_round_trip > $OUT/pytest.txt 2>&1
echo "tests rc $?"; tail -2 $OUT/pytest.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest.txt | cut -c1-250
mkdir -p /tmp/s59 /tmp/s59/traces
for case in ${CASES:-on-off off-off on-on}; do
  wire=${case%-*} vram=${case#*-}
  extra=""; [ "$case" = on-off ] && extra="--trace /tmp/s59/traces"
  VRAMSHARD_WIRE_CODEC=$wire VRAMSHARD_VRAM_CODEC=$vram timeout ${STEPS_S:-150} python3 -m benchmarks.step_profile \
    --shape llama3-8b --placements ${PLACEMENTS:-planned:8+graphs,planned:12+graphs} --profile "$PROFILE" \
    --pystats 30 $extra --json /tmp/s59/steps_$case.json > /tmp/s59/steps_$case.log 2>&1
  echo "step_profile link $wire vram $vram rc $?"; step_summary /tmp/s59/steps_$case.json
  grep -E "host memory read|'wall_ms'" /tmp/s59/steps_$case.log | cut -c1-400
done
gzip -f /tmp/s59/traces/*.json 2>/dev/null
tar -C /tmp/s59 -czf $OUT/steps.tgz . && ls -la $OUT
