# ~7 min (written 2026-12-07 in session 56). Pinned weights kept coded in VRAM (runtime/vram_coded,
# VRAMSHARD_VRAM_CODEC): its tests with the link codec's and the executor's GPU tests (the ring decodes coded pins
# now), then llama3-8b at 8 GiB (decode, TTFT, batch 64 against layers:max) with the VRAM codec off and on
# (VRAM_CODECS, default "on off on"), one process each, the link codec on in all (WIRE, default on); BUDGETS (GiB,
# default 8).
source benchmarks/gpu_session/setup.sh || exit 1
timeout ${TESTS_S:-200} python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider tests/test_vram_coded.py \
  tests/test_wire_codec.py tests/test_executor_gpu.py > $OUT/pytest_vram_coded.txt 2>&1
echo "tests rc $?"; tail -2 $OUT/pytest_vram_coded.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest_vram_coded.txt | cut -c1-250
export VRAMSHARD_WIRE_CODEC=${WIRE:-on}
switch_runs VRAMSHARD_VRAM_CODEC "${VRAM_CODECS:-on off on}" vcodec ${RUN_S:-130} --models llama3-8b --budgets ${BUDGETS:-8} \
  --batch-sizes 64 --repeat 1 --deadline-s 120 --run-limit-s 10
grep -hE "coded in VRAM|pinned set" $OUT/vcodec_*.log | cut -c1-250
