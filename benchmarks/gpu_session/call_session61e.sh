# ~8 min (written 2026-12-07 in session 61; `timeout_s` 590; after call_session61d.sh where its step profiles show the
# worker's one-call parts ahead). The engine with split FFNs' few-row CPU parts on the run-ahead worker as one bound C
# call (VRAMSHARD_RUN_AHEAD=bound; a batch-64 step's parts stay on the host thread) against the default (auto: every
# part on the host thread), one process each: llama3-8b at 8 GiB, decode (tg) and batch 64 against layers:17 in the
# same process (engine_bench), each cell with the load beside it. ORDER: the values in process order.
[ -z "${PROFILE:-}" ] && [ -f bench_out/profile-run61a.json ] && export PROFILE=bench_out/profile-run61a.json
source benchmarks/gpu_session/setup.sh || exit 1
i=0
for ahead in ${ORDER:-bound auto}; do
  i=$((i + 1))
  ( export VRAMSHARD_RUN_AHEAD=$ahead
    engine_step ahead_${ahead}_$i ${ENGINE_S:-200} --models llama3-8b --budgets 8 --batch-sizes 1,64 --repeat 1 \
      --deadline-s $(( ${ENGINE_S:-200} - 40 )) --run-limit-s 10
    grep -E "fitted|took" $OUT/ahead_${ahead}_$i.log | cut -c1-260 | tail -4 )
done
tar -C $OUT -czf /tmp/call.tgz . && find $OUT -mindepth 1 -delete && mv /tmp/call.tgz $OUT/ && ls -la $OUT
