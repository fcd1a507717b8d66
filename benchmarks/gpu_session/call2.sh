# ~8 min: the nemo-8b grid at 8 and 2 GiB (decode at 1K context against the paper's 12.4 and 7.6
# tok/s, batch 64, TTFT, and layers:max at both budgets), planned from PROFILE, prepacked CPU
# weights as the switches in the environment say (none: the compiled projections).
source benchmarks/gpu_session/setup.sh || exit 1
PROFILE=${PROFILE:-docs/profiles/h200-run15.json}; echo "profile $PROFILE"
env | grep ^VRAMSHARD_ > $OUT/switches.txt; cat $OUT/switches.txt
timeout 450 python3 -m benchmarks.engine_bench --models nemo-8b --budgets 8,2 --deadline-s 400 \
  --profile $PROFILE --out $OUT/engine_nemo.json > $OUT/engine_nemo.log 2>&1; echo "rc $?"
grep -o '"[0-9]GiB_[a-z0-9_]*": [0-9.]*' $OUT/engine_nemo.json
grep -E "took|fitted|not fitted|memory limit" $OUT/engine_nemo.log | cut -c1-260
