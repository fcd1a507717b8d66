# ~8 min (written 2026-12-07 in session 61; `timeout_s` 590, or what the device time left allows: each stage adds
# its files to $OUT/call.tgz as it ends, so a call cut short returns the stages done). Session 61's CPU work on a GPU
# machine's host: FFN work of 5-64 rows through the CPU's matrix tiles (VRAMSHARD_CPU_AMX=on; off beside a GPU by
# default), and
# split dense FFNs' few-row CPU parts on the run-ahead worker as one bound C call (cpu_gemv.bind_swiglu_part), the
# host thread meanwhile queuing the GPU's work and the ring's fills (the fifty-fifth session's step profile had the
# host thread compute the parts, 57.5 ms, then issue the fills, 25 ms under cProfile: a 79 ms planned:8 step priced
# 44). Stages, most wanted first:
# 1. The tiles' own tests on this host's CPU.
# 2. step_profile of llama3-8b planned:8+graphs at 64 rows with the tiles off, then on (one process each).
# 3. The same at 1 row: the parts on the host thread and (+ahead) on the worker, ABAB in one process (wall, host
#    compute, the parts' and copies' rates; cProfile of the host thread after the timed steps).
# 4. benchmarks.cpu_gemv: a split part at 1 row (one call against three) and at 16 and 64 rows (tiles, oneDNN, torch).
# 5. The GPU tests of the run-ahead worker and the split FFNs, and (session 62) of the profile's coded fill issue.
[ -z "${PROFILE:-}" ] && [ -f bench_out/profile-run61a.json ] && export PROFILE=bench_out/profile-run61a.json
source benchmarks/gpu_session/setup.sh || exit 1
W=/tmp/call61d; mkdir -p $W
keep() { tar -C $W -czf $OUT/call.tgz . ; }
timeout 60 python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider tests/test_cpu_gemv.py -k "tiles or swiglu" \
  > $W/pytest_tiles.txt 2>&1
echo "tiles tests rc $?"; tail -2 $W/pytest_tiles.txt; grep -E "^(FAILED|ERROR)" $W/pytest_tiles.txt | cut -c1-250; keep
P=planned:8+graphs; A=planned:8+graphs+ahead
for amx in off on; do
  VRAMSHARD_CPU_AMX=$amx VRAMSHARD_WIRE_CODEC=on timeout ${STEPS64_S:-80} python3 -m benchmarks.step_profile \
    --shape llama3-8b --seqs 64 --placements $P --profile "$PROFILE" --json $W/steps64_$amx.json \
    > $W/steps64_$amx.log 2>&1
  echo "seqs 64 tiles $amx rc $? load $(cut -d' ' -f1-3 /proc/loadavg)"; step_summary $W/steps64_$amx.json; keep
done
# (step_profile sets the worker from the placement's name: NAME+ahead gives it split parts, NAME alone nothing.)
VRAMSHARD_WIRE_CODEC=on timeout ${STEPS_S:-120} python3 -m benchmarks.step_profile --shape llama3-8b \
  --placements ${ORDER:-$P,$A,$P,$A} --profile "$PROFILE" --pystats 30 --json $W/steps1.json > $W/steps1.log 2>&1
echo "seqs 1 rc $? load $(cut -d' ' -f1-3 /proc/loadavg)"; step_summary $W/steps1.json; keep
timeout ${GEMV_S:-60} python3 -m benchmarks.cpu_gemv --rows 1 --reps 7 --out $W/cpu_gemv.json > $W/cpu_gemv.log 2>&1
echo "cpu_gemv rc $?"; grep -E "split part|host read" $W/cpu_gemv.log | cut -c1-300; keep
timeout ${TESTS_S:-150} python3 -m pytest -m gpu -q -rfEs --tb=short -p no:cacheprovider tests/test_run_ahead.py \
  tests/test_executor_gpu.py tests/test_split_ffn.py tests/test_cpu_gemv.py tests/test_estimator_fills.py \
  > $W/pytest_gpu.txt 2>&1
echo "gpu tests rc $?"; tail -2 $W/pytest_gpu.txt; grep -E "^(FAILED|ERROR)" $W/pytest_gpu.txt | cut -c1-250; keep
ls -la $OUT
