# ~8 min (written 2026-12-07 in session 58). The GPU tests of session 57's commits (the coded link's own decode
# stream, coded pins copied from the link codec's host copies, the link codec on by default), then decode steps of
# llama3-8b planned at 12 and 8 GiB with CUDA graphs, both codecs on and the VRAM codec off (benchmarks.step_profile:
# wall against kernels, copies, host waits and launches): do coded pins cost the decode graphs?
source benchmarks/gpu_session/setup.sh || exit 1
timeout ${TESTS_S:-150} python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider tests/test_vram_coded.py \
  tests/test_wire_codec.py tests/test_executor_gpu.py tests/test_estimator_graphs.py \
  tests/test_profile.py::test_gpu_profile_round_trip > $OUT/pytest_vram_coded.txt 2>&1
echo "tests rc $?"; tail -2 $OUT/pytest_vram_coded.txt
grep -E "^(FAILED|ERROR)" $OUT/pytest_vram_coded.txt | cut -c1-250
python3 -c "from vramshard.profile.bench_dispatch import measure_dispatch as d, measure_graph_replay as g
print('eager tiny sub-layer', d('cuda', 0.5), 'graph replay', g(0.5))"
for vram in ${VRAM_CODECS:-on off}; do
  VRAMSHARD_WIRE_CODEC=on VRAMSHARD_VRAM_CODEC=$vram timeout ${STEPS_S:-170} python3 -m benchmarks.step_profile \
    --shape llama3-8b --placements ${PLACEMENTS:-planned:12+graphs,planned:8+graphs} --profile "$PROFILE" \
    --json $OUT/steps_vram_$vram.json > $OUT/steps_vram_$vram.log 2>&1
  echo "step_profile vram codec $vram rc $?"; step_summary $OUT/steps_vram_$vram.json
  grep -E "^(planned|  wall|wall)|launch|coded" $OUT/steps_vram_$vram.log | cut -c1-220 | head -20
done
