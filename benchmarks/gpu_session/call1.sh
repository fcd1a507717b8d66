# ~9 min on a fresh machine: the GPU tests, then llama3-8b at 8 GiB with the 1K prompt timed three
# times (--repeat 3), planned from PROFILE: is the sixteenth session's 1.18 s TTFT (0.18 s in the
# fifteenth) a one-off first prompt step after a re-plan, or every prompt? Each run's TTFT is the
# JSON's ttft_runs_s (ttft_s is their median).
source benchmarks/gpu_session/setup.sh || exit 1
timeout 300 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=10 > $OUT/pytest_gpu.txt 2>&1; tail -3 $OUT/pytest_gpu.txt
grep -E "^(FAILED|ERROR)" $OUT/pytest_gpu.txt | cut -c1-250
PROFILE=${PROFILE:-docs/profiles/h200-run15.json}
timeout 230 python3 -m benchmarks.engine_bench --models llama3-8b --budgets 8 --batch-sizes 1 --repeat 3 \
  --deadline-s 200 --profile $PROFILE --out $OUT/engine_llama_ttft.json > $OUT/engine_llama_ttft.log 2>&1; echo "rc $?"
grep -o '"8GiB_ttft[a-z_]*": [0-9.]*' $OUT/engine_llama_ttft.json; grep -o '"ttft_runs_s": [^]]*]' $OUT/engine_llama_ttft.json
grep -E "ttft|reconfigured|fitted|KV cache to host" $OUT/engine_llama_ttft.log | cut -c1-240
