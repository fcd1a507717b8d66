# ~9.5 min (written 2026-12-07 in session 61; `timeout_s` 590). Session 61's CPU work on a GPU machine's host:
# split dense FFNs' few-row CPU parts on the run-ahead worker as one bound C call (cpu_gemv.bind_swiglu_part), the
# host thread meanwhile queuing the GPU's work and the ring's fills (the fifty-fifth session's step profile had the
# host thread compute the parts, 57.5 ms, then issue the fills, 25 ms under cProfile: a 79 ms planned:8 step priced
# 44); and FFN work of 5-64 rows through the CPU's matrix tiles (VRAMSHARD_CPU_AMX=on; off by default).
# 1. The GPU tests of the run-ahead worker and the split FFNs, and the tiles' own tests on this host's CPU.
# 2. benchmarks.cpu_gemv: a split part at 1 row (one call against three) and at 16 and 64 rows (tiles, oneDNN, torch).
# 3. step_profile of llama3-8b planned:8+graphs at 1 row: the parts on the host thread and (+ahead) on the worker,
#    ABAB in one process (wall, host compute, the parts' and copies' rates; cProfile of the host thread after).
# 4. The same at 64 rows with the tiles off, then on (one process each).
# Everything comes back in $OUT/call.tgz (at most 8 files come back).
[ -z "${PROFILE:-}" ] && [ -f bench_out/profile-run61a.json ] && export PROFILE=bench_out/profile-run61a.json
source benchmarks/gpu_session/setup.sh || exit 1
timeout ${TESTS_S:-150} python3 -m pytest -m gpu -q -rfEs --tb=short -p no:cacheprovider tests/test_run_ahead.py \
  tests/test_executor_gpu.py tests/test_split_ffn.py tests/test_cpu_gemv.py > $OUT/pytest_gpu.txt 2>&1
echo "gpu tests rc $?"; tail -2 $OUT/pytest_gpu.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest_gpu.txt | cut -c1-250
timeout 60 python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider tests/test_cpu_gemv.py -k "tiles or swiglu" \
  > $OUT/pytest_tiles.txt 2>&1
echo "tiles tests rc $?"; tail -2 $OUT/pytest_tiles.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest_tiles.txt | cut -c1-250
timeout ${GEMV_S:-70} python3 -m benchmarks.cpu_gemv --rows 1 --reps 9 --out $OUT/cpu_gemv.json > $OUT/cpu_gemv.log 2>&1
echo "cpu_gemv rc $?"; grep -E "split part|host read" $OUT/cpu_gemv.log | cut -c1-300
# (step_profile sets the worker from the placement's name: NAME+ahead gives it split parts, NAME alone nothing.)
P=planned:8+graphs; A=planned:8+graphs+ahead
VRAMSHARD_WIRE_CODEC=on timeout ${STEPS_S:-150} python3 -m benchmarks.step_profile --shape llama3-8b \
  --placements ${ORDER:-$P,$A,$P,$A} --profile "$PROFILE" --pystats 30 --json $OUT/steps1.json > $OUT/steps1.log 2>&1
echo "seqs 1 rc $? load $(cut -d' ' -f1-3 /proc/loadavg)"; step_summary $OUT/steps1.json
for amx in off on; do
  VRAMSHARD_CPU_AMX=$amx VRAMSHARD_WIRE_CODEC=on timeout ${STEPS64_S:-90} python3 -m benchmarks.step_profile \
    --shape llama3-8b --seqs 64 --placements $P --profile "$PROFILE" --json $OUT/steps64_$amx.json \
    > $OUT/steps64_$amx.log 2>&1
  echo "seqs 64 tiles $amx rc $? load $(cut -d' ' -f1-3 /proc/loadavg)"; step_summary $OUT/steps64_$amx.json
done
tar -C $OUT -czf /tmp/call.tgz . && find $OUT -mindepth 1 -delete && mv /tmp/call.tgz $OUT/ && ls -la $OUT
