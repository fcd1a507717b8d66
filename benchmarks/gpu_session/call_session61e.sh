# ~8 min (written 2026-12-07 in session 61; `timeout_s` 590; after call_session61d.sh). The engine with session 61's
# CPU work switched on against the defaults, one process each: llama3-8b at 8 GiB, decode (tg) and batch 64 against
# layers:17 in the same process (engine_bench), each cell with the load beside it. RUNS: AHEAD:AMX pairs in process
# order, VRAMSHARD_RUN_AHEAD (auto, the default: the parts on the host thread; bound: a decode step's few-row parts
# on the worker as one C call) and VRAMSHARD_CPU_AMX (off, the default beside a GPU; on: FFN work of 5-64 rows
# through the CPU's matrix tiles, the layers:17 baseline's CPU layers included). Default "bound:on auto:off".
[ -z "${PROFILE:-}" ] && [ -f bench_out/profile-run61a.json ] && export PROFILE=bench_out/profile-run61a.json
source benchmarks/gpu_session/setup.sh || exit 1
i=0
for run in ${RUNS:-bound:on auto:off}; do
  i=$((i + 1)); ahead=${run%%:*}; amx=${run##*:}
  ( export VRAMSHARD_RUN_AHEAD=$ahead VRAMSHARD_CPU_AMX=$amx
    engine_step run_${ahead}_${amx}_$i ${ENGINE_S:-200} --models llama3-8b --budgets 8 --batch-sizes 1,64 --repeat 1 \
      --deadline-s $(( ${ENGINE_S:-200} - 40 )) --run-limit-s 10
    grep -E "fitted|took" $OUT/run_${ahead}_${amx}_$i.log | cut -c1-260 | tail -4 )
done
tar -C $OUT -czf /tmp/call.tgz . && find $OUT -mindepth 1 -delete && mv /tmp/call.tgz $OUT/ && ls -la $OUT
