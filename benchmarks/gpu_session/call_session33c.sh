# ~9.5 min (written 2026-12-05 in session 32). With PROFILE= the profile of call_session33b.sh (timed
# through the C decode kernel): nemo-8b at 8 and 2 GiB against layers:max (the Planner issue's 12.4 and
# 7.6 tok/s), then llama3-8b at 8 GiB batch 1 and 64 (the Engine issue's 3x).
source benchmarks/gpu_session/setup.sh || exit 1
timeout 260 python3 -m benchmarks.engine_bench --models nemo-8b --budgets 8,2 --batch-sizes 1 \
  --deadline-s 200 --run-limit-s 10 --profile ${PROFILE:-docs/profiles/h200-run26b.json} \
  --out $OUT/nemo_decode.json > $OUT/nemo_decode.log 2>&1; echo "nemo rc $?"
python3 benchmarks/gpu_session/engine_summary.py $OUT/nemo_decode.json 2>&1 | tail -6
timeout 280 python3 -m benchmarks.engine_bench --models llama3-8b --budgets 8 --batch-sizes 1,64 \
  --deadline-s 220 --run-limit-s 12 --profile ${PROFILE:-docs/profiles/h200-run26b.json} \
  --out $OUT/llama_b64.json > $OUT/llama_b64.log 2>&1; echo "llama rc $?"
python3 benchmarks/gpu_session/engine_summary.py $OUT/llama_b64.json 2>&1 | tail -5
