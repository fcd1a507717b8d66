# ~9.5 min on a fresh machine (written 2026-12-05 in session 32). 1. The four GPU tests fixed in session
# 31 for prepacked parts (not yet GPU-run). 2. nemo-8b at 8 then 2 GiB, the default (first tier's CPU
# parts packed at load, no one-token projection compile where the CPU holds only packed parts), each
# against layers:max in the same run: the Planner issue's 12.4 / 7.6 tok/s cells and the load timeline.
source benchmarks/gpu_session/setup.sh || exit 1
timeout 150 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/test_executor_gpu.py -k "split_ffn or run_ahead" \
  > $OUT/pytest_fixed.txt 2>&1; echo "tests rc $?"; tail -2 $OUT/pytest_fixed.txt
grep -E "^(FAILED|ERROR)" $OUT/pytest_fixed.txt | cut -c1-250
timeout 400 python3 -m benchmarks.engine_bench --models nemo-8b --budgets 8,2 --batch-sizes 1 \
  --deadline-s 330 --run-limit-s 12 --profile ${PROFILE:-docs/profiles/h200-run26b.json} \
  --out $OUT/nemo_decode.json > $OUT/nemo_decode.log 2>&1; echo "nemo rc $?"
python3 benchmarks/gpu_session/engine_summary.py $OUT/nemo_decode.json 2>&1 | tail -8
grep -E "took \{1:|loaded " $OUT/nemo_decode.log | cut -c1-330 | head -8
