# ~8 min (written 2026-12-07 in session 59). Coded fills replayed from CUDA graphs (VRAMSHARD_FILL_GRAPHS, on by
# default): their GPU tests, then llama3-8b's planned decode steps at 8 and 12 GiB (link codec on, VRAM codec off)
# with the fill graphs on, off, on (benchmarks.step_profile: wall against host compute, copies and predicted; in
# call 1 the host thread was busy the whole 84 ms step, ~20 ms more than with raw fills), then batch 64 at 8 GiB
# planned against layers:17 paired (benchmarks.paired_decode) where time is left.
source benchmarks/gpu_session/setup.sh || exit 1
timeout ${TESTS_S:-150} python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider tests/test_wire_codec.py \
  tests/test_budget.py tests/test_vram_coded.py > $OUT/pytest.txt 2>&1
echo "tests rc $?"; tail -2 $OUT/pytest.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest.txt | cut -c1-250
mkdir -p /tmp/s59c
i=0
for graphs in ${FILLS:-on off on}; do
  i=$((i + 1))
  VRAMSHARD_FILL_GRAPHS=$graphs VRAMSHARD_WIRE_CODEC=on VRAMSHARD_VRAM_CODEC=off timeout ${STEPS_S:-120} \
    python3 -m benchmarks.step_profile --shape llama3-8b --placements ${PLACEMENTS:-planned:8+graphs,planned:12+graphs} \
    --profile "$PROFILE" --pystats 30 --json /tmp/s59c/steps_${graphs}_$i.json > /tmp/s59c/steps_${graphs}_$i.log 2>&1
  echo "step_profile fill graphs $graphs rc $?"; step_summary /tmp/s59c/steps_${graphs}_$i.json
  grep -E "host memory read|a coded fill could not" /tmp/s59c/steps_${graphs}_$i.log | cut -c1-300
done
if [ $SECONDS -lt ${PAIRED_AFTER:-330} ]; then
  timeout ${PAIRED_S:-170} python3 -m benchmarks.paired_decode --model llama3-8b --budgets 8 --pps 16 --batch 64 \
    --rounds 2 --steps 4 --profile "$PROFILE" --json /tmp/s59c/paired_b64.json > /tmp/s59c/paired_b64.log 2>&1
  echo "paired rc $?"; grep -E "vramshard [0-9]|round|Error|error" /tmp/s59c/paired_b64.log | tail -10 | cut -c1-300
fi
tar -C /tmp/s59c -czf $OUT/steps.tgz . && ls -la $OUT
