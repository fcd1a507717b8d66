# ~9.5 min (written 2026-12-07 in session 61; `timeout_s` 590). Split dense FFNs' few-row CPU parts on the run-ahead
# worker as one bound C call (cpu_gemv.bind_swiglu_part, since session 61), the host thread meanwhile queuing the
# GPU's work and the ring's fills: the fifty-fifth session's step profile had the host thread compute the parts
# (57.5 ms) and then issue the fills (25 ms under cProfile) one after the other, a 79 ms planned:8 step priced 44.
# 1. The GPU tests of the run-ahead worker and the split FFNs (the bound part runs in one of them).
# 2. step_profile of llama3-8b planned:8+graphs at 1 and 64 rows, the parts on the host thread and (+ahead) on the
#    worker, in ABAB order in one process: wall, host compute, the parts' rate, the copies' rate, and (cProfile, after
#    the timed steps) what the host thread spends its step on.
# Everything comes back in $OUT/call.tgz (at most 8 files come back).
[ -z "${PROFILE:-}" ] && [ -f bench_out/profile-run61a.json ] && export PROFILE=bench_out/profile-run61a.json
source benchmarks/gpu_session/setup.sh || exit 1
timeout ${TESTS_S:-150} python3 -m pytest -m gpu -q -rfEs --tb=short -p no:cacheprovider tests/test_run_ahead.py \
  tests/test_executor_gpu.py tests/test_split_ffn.py tests/test_cpu_gemv.py > $OUT/pytest_gpu.txt 2>&1
echo "tests rc $?"; tail -2 $OUT/pytest_gpu.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest_gpu.txt | cut -c1-250
# (step_profile sets the worker from the placement's name: NAME+ahead gives it split parts, NAME alone nothing.)
P=planned:8+graphs; A=planned:8+graphs+ahead
for seqs in 1 64; do
  VRAMSHARD_WIRE_CODEC=on timeout ${STEPS_S:-200} python3 -m benchmarks.step_profile --shape llama3-8b --seqs $seqs \
    --placements ${ORDER:-$P,$A,$P,$A} --profile "$PROFILE" --pystats 30 --json $OUT/steps$seqs.json \
    > $OUT/steps$seqs.log 2>&1
  echo "seqs $seqs rc $? load $(cut -d' ' -f1-3 /proc/loadavg)"; step_summary $OUT/steps$seqs.json
done
tar -C $OUT -czf /tmp/call.tgz . && find $OUT -mindepth 1 -delete && mv /tmp/call.tgz $OUT/ && ls -la $OUT
