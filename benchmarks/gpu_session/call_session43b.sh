# ~9 min (written 2026-12-06 in session 43; session 42's list, step 3). Dense split FFN parts on the run-ahead
# worker: llama3-8b at 8 GiB in engine_bench (TTFT, decode, batch 1 and 64 against layers:max) with
# VRAMSHARD_RUN_AHEAD=on (split parts and MoE experts on the worker) and the default auto (MoE experts only),
# two of each, alternating, one process each. Compare each pair's vramshard decode tok/s and batch-64 tok/s;
# layers:max in the same run is the baseline that moves with the host.
source benchmarks/gpu_session/setup.sh || exit 1
i=0
for ahead in ${AHEADS:-on auto on auto}; do
  i=$((i + 1))
  VRAMSHARD_RUN_AHEAD=$ahead engine_step llama8_ahead_${ahead}_$i 130 --models llama3-8b --budgets 8 \
    --batch-sizes 1,64 --repeat 1 --deadline-s 110 --run-limit-s 8
  echo "run-ahead $ahead load $(cut -d' ' -f1-3 /proc/loadavg)"
done
