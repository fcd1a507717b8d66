# ~9 min on a fresh machine: GPU tests (the changed graph-pool test among them), then the llama3-8b
# engine grid at 8 and 2 GiB planned from the fifteenth session's profile, without prepacked CPU
# weights, so split FFN parts take the compiled one-token projections over their column slices.
# Check: the planned decode against layers:17 at 8 GiB (9.73 against 10.10 in the fifteenth), no
# "the graph memory limit is reached" at 1K context, and no calibration at the limit of its factors.
source benchmarks/gpu_session/setup.sh || exit 1
timeout 220 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=5 > $OUT/pytest_gpu.txt 2>&1; tail -3 $OUT/pytest_gpu.txt
grep -E "^(FAILED|ERROR)" $OUT/pytest_gpu.txt | cut -c1-250
PROFILE=${PROFILE:-docs/profiles/h200-run15.json}; echo "profile $PROFILE"
env | grep ^VRAMSHARD_ > $OUT/switches.txt; cat $OUT/switches.txt
timeout 330 python3 -m benchmarks.engine_bench --models llama3-8b --budgets 8,2 --deadline-s 300 \
  --profile $PROFILE --out $OUT/engine_llama.json > $OUT/engine_llama.log 2>&1; echo "rc $?"
grep -o '"[0-9]GiB_[a-z0-9_]*": [0-9.]*' $OUT/engine_llama.json
grep -E "took|fitted|not fitted|memory limit" $OUT/engine_llama.log | cut -c1-260
