# ~9.5 min (written 2026-12-07 in session 59 for the next session; `timeout_s` 590). Coded fills replayed from CUDA
# graphs (VRAMSHARD_FILL_GRAPHS, on by default since session 59) in the engine: llama3-8b at 8 GiB, decode (tg) and
# batch 64 against layers:max (layers:17 there), one process with them on and one off (engine_bench; its decode
# check's dispatch fit says how much host work is left unpriced), benchmarks.wire_codec (a fill issued round by round
# against its graph's replay: GPU time and the host's), then the step profile with the parts' and copies' rates
# (step_profile's split_part_gbps and copy_gbps). ORDER: the switch's values in process order (default "on off").
# Everything comes back in $OUT/call.tgz (at most 8 files come back).
source benchmarks/gpu_session/setup.sh || exit 1
for graphs in ${ORDER:-on off}; do
  ( export VRAMSHARD_FILL_GRAPHS=$graphs
    engine_step fills_$graphs ${ENGINE_S:-180} --models llama3-8b --budgets 8 --batch-sizes 1,64 --repeat 1 \
      --deadline-s $(( ${ENGINE_S:-180} - 40 )) --run-limit-s 10
    grep -E "fitted|took" $OUT/fills_$graphs.log | cut -c1-260 | tail -4 )
done
timeout ${CODEC_S:-80} python3 -m benchmarks.wire_codec --out $OUT/wire_codec.json > $OUT/wire_codec.log 2>&1
echo "wire_codec rc $?"; grep -E "overlapped" $OUT/wire_codec.log | cut -c1-330
VRAMSHARD_WIRE_CODEC=on timeout ${STEPS_S:-100} python3 -m benchmarks.step_profile --shape llama3-8b \
  --placements planned:8+graphs,planned:12+graphs --profile "$PROFILE" --pystats 40 --json $OUT/steps.json \
  > $OUT/steps.log 2>&1
echo "step_profile rc $?"; step_summary $OUT/steps.json
tar -C $OUT -czf /tmp/call.tgz . && find $OUT -mindepth 1 -delete && mv /tmp/call.tgz $OUT/ && ls -la $OUT
