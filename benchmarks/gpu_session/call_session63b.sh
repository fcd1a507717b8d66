# ~9 min (written 2026-12-07 in session 63; `timeout_s` 590, or what the device time left allows; stages keep their
# files in $OUT/call.tgz as they end). After call_session63a.sh found the 64-row step at 8 GiB host-bound (the
# gather of the host KV cache at ~35 GB/s, 263 ms a step, and ~8200 per-sequence copies, ~100 ms): the staging now
# gathers into the staging cache's order and copies each layer's prefixes in one copy, and writes new rows back by
# one device gather and one copy.
# 1. step_profile of llama3-8b at 64 rows of 1K context, 8 GiB (planned:8+graphs, twice): predicted against measured.
# 2. The GPU tests of the KV staging and the executor.
# 3. call_session61e.sh's engine_bench A/B of the CPU's matrix tiles beside the GPU (auto:on, auto:off), shorter.
source benchmarks/gpu_session/setup.sh || exit 1
W=/tmp/call63b; mkdir -p $W
keep() { tar -C $W -czf $OUT/call.tgz . ; }
P=planned:8+graphs
VRAMSHARD_WIRE_CODEC=on timeout ${STEPS64_S:-130} python3 -m benchmarks.step_profile --shape llama3-8b --seqs 64 \
  --placements $P,$P --profile "$PROFILE" --json $W/steps64.json > $W/steps64.log 2>&1
echo "seqs 64 rc $? load $(cut -d' ' -f1-3 /proc/loadavg)"; step_summary $W/steps64.json; keep
grep -E "^ +[0-9]+ +[0-9]+  (aten::index_select|cudaMemcpyAsync|aten::copy_)" $W/steps64.log | head -6
timeout ${TESTS_S:-90} python3 -m pytest -m gpu -q -rfEs --tb=short -p no:cacheprovider tests/test_kv_staging.py \
  tests/test_executor_gpu.py > $W/pytest_gpu.txt 2>&1
echo "gpu tests rc $?"; tail -2 $W/pytest_gpu.txt; grep -E "^(FAILED|ERROR)" $W/pytest_gpu.txt | cut -c1-250; keep
OUT=$W ENGINE_S=${ENGINE_S:-165} RUNS="auto:on auto:off" bash benchmarks/gpu_session/call_session61e.sh 2>&1 | grep -v "^total\|^d\|^-"
tar -C $W -czf $OUT/call.tgz . 2>/dev/null; ls -la $OUT
