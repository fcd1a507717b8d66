# ~9 min on a fresh machine: the GPU tests (they cover the seventeenth session's revert of a slower
# re-plan, budget_follower.py, which has not run on a GPU), then llama3-8b at 8 GiB, batch 1 and 64,
# medians of two, planned from PROFILE. In the seventeenth session two dispatch fits re-planned this
# engine from 91 ms to 122 ms decode steps and its batch-1 cell lost to layers:17 (4.86 against 8.32
# tok/s): look in the log for "going back to it" and in the JSON's calibrations for "reverted_to".
source benchmarks/gpu_session/setup.sh || exit 1
timeout 300 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=10 > $OUT/pytest_gpu.txt 2>&1; tail -3 $OUT/pytest_gpu.txt
grep -E "^(FAILED|ERROR)" $OUT/pytest_gpu.txt | cut -c1-250
PROFILE=${PROFILE:-docs/profiles/h200-run15.json}
timeout 230 python3 -m benchmarks.engine_bench --models llama3-8b --budgets 8 --batch-sizes 1,64 --repeat 2 \
  --deadline-s 200 --profile $PROFILE --out $OUT/engine_llama.json > $OUT/engine_llama.log 2>&1; echo "rc $?"
grep -o '"8GiB_[a-z0-9_]*": [0-9.]*' $OUT/engine_llama.json; grep -o '"reverted_to[a-z_]*": [^,]*' $OUT/engine_llama.json
grep -E "took|fitted|going back|reconfigured|memory limit" $OUT/engine_llama.log | cut -c1-240
