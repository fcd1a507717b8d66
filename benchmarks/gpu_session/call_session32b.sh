# ~8 min on a warm or fresh machine (written 2026-12-05 in session 32). The C decode kernel
# (layers/cpu_gemv.c: one-row products that read each weight row once; split parts' one-row CPU work
# from the plain weights, no prepacked copy): 1. against oneDNN (prepacked) and F.linear per projection
# shape and for a whole split part, bf16 and fp16, beside the host's read; 2. its GPU tests; 3. nemo-8b
# at 8 GiB with the kernel (default) and without it (+no-gemv) in one run, against layers:max; 4. at 2 GiB.
source benchmarks/gpu_session/setup.sh || exit 1
for dt in bf16 fp16; do
  timeout 70 python3 -m benchmarks.cpu_gemv --dtype $dt --reps 9 --out $OUT/cpu_gemv_$dt.json > $OUT/cpu_gemv_$dt.log 2>&1
  echo "gemv $dt rc $?"; grep -E "host read|shape" $OUT/cpu_gemv_$dt.log | cut -c25-330
done
timeout 100 python3 -m pytest -q -rs -p no:cacheprovider tests/test_cpu_gemv.py tests/test_executor_gpu.py \
  -k "gemv or split_ffn or run_ahead" > $OUT/pytest_gemv.txt 2>&1; echo "tests rc $?"; tail -2 $OUT/pytest_gemv.txt
grep -E "^(FAILED|ERROR)" $OUT/pytest_gemv.txt | cut -c1-250
timeout 200 python3 -m benchmarks.engine_bench --models nemo-8b --budgets 8 --batch-sizes 1 --without-gemv \
  --deadline-s 150 --run-limit-s 10 --profile ${PROFILE:-docs/profiles/h200-run26b.json} \
  --out $OUT/nemo8_gemv.json > $OUT/nemo8_gemv.log 2>&1; echo "nemo 8 rc $?"
python3 benchmarks/gpu_session/engine_summary.py $OUT/nemo8_gemv.json 2>&1 | tail -6
grep -E "loaded |CPU decode kernel" $OUT/nemo8_gemv.log | cut -c1-250 | head -6
timeout 150 python3 -m benchmarks.engine_bench --models nemo-8b --budgets 2 --batch-sizes 1 \
  --deadline-s 100 --run-limit-s 10 --profile ${PROFILE:-docs/profiles/h200-run26b.json} \
  --out $OUT/nemo2_gemv.json > $OUT/nemo2_gemv.log 2>&1; echo "nemo 2 rc $?"
python3 benchmarks/gpu_session/engine_summary.py $OUT/nemo2_gemv.json 2>&1 | tail -4
