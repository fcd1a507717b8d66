# ~9.5 min, after call_session31a.sh (written 2026-12-05 in session 31; prepacked CPU parts are the
# default beside a GPU since then). 1. nemo-8b at 8 GiB with the run-ahead worker on: the split parts
# on a worker while the host thread queues the step (at 1 row, last measured before the GIL fixes of the
# fourteenth session); compare with 31a's default. 2. llama3-8b at 8 GiB, batch 1 and 64 against
# layers:max (the Engine issue's 3x cell), the default.
source benchmarks/gpu_session/setup.sh || exit 1
VRAMSHARD_RUN_AHEAD=on timeout 175 python3 -m benchmarks.engine_bench --models nemo-8b --budgets 8 --batch-sizes 1 \
  --deadline-s 100 --run-limit-s 12 --profile ${PROFILE:-docs/profiles/h200-run26b.json} \
  --out $OUT/nemo_decode_ahead.json > $OUT/nemo_decode_ahead.log 2>&1; echo "nemo ahead rc $?"
python3 benchmarks/gpu_session/engine_summary.py $OUT/nemo_decode_ahead.json 2>&1 | tail -4
timeout 340 python3 -m benchmarks.engine_bench --models llama3-8b --budgets 8 --batch-sizes 1,64 \
  --deadline-s 250 --run-limit-s 12 --profile ${PROFILE:-docs/profiles/h200-run26b.json} \
  --out $OUT/llama_b64.json > $OUT/llama_b64.log 2>&1; echo "llama rc $?"
python3 benchmarks/gpu_session/engine_summary.py $OUT/llama_b64.json 2>&1 | tail -5
