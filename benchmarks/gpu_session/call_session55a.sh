# ~5 min (written 2026-12-07 in session 55). The link codec (runtime/wire_codec.py, VRAMSHARD_WIRE_CODEC): its
# tests and the executor's GPU tests (the ring's fills were rewritten for it), the fills raw and coded against the
# link's bound (benchmarks/wire_codec.py), then llama3-8b at 8 GiB (decode, TTFT, batch 64 against layers:max)
# with the codec off and on (CODECS, default "off on"), one process each.
source benchmarks/gpu_session/setup.sh || exit 1
timeout ${TESTS_S:-200} python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider tests/test_wire_codec.py \
  tests/test_executor_gpu.py > $OUT/pytest_codec.txt 2>&1
echo "codec tests rc $?"; tail -2 $OUT/pytest_codec.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest_codec.txt | cut -c1-250
timeout 120 python3 -m benchmarks.wire_codec --out $OUT/wire_codec.json > $OUT/wire_codec.log 2>&1
echo "wire_codec rc $?"; cut -c25-330 $OUT/wire_codec.log | grep -v "^$"
switch_runs VRAMSHARD_WIRE_CODEC "${CODECS:-off on}" codec ${RUN_S:-150} --models llama3-8b --budgets 8 \
  --batch-sizes 64 --repeat 1 --deadline-s 130 --run-limit-s 10
grep -hE "coded [0-9]+ streamed" $OUT/codec_*.log | cut -c1-250
