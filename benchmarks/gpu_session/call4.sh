# ~7 min: the nemo-8b grid at 8 and 2 GiB with prepacked CPU weights (decode at 1K context against
# the paper's 12.4 and 7.6 tok/s, batch 64, TTFT), planned from PROFILE (call 2's, with the
# prepacked-FFN factors).
source benchmarks/gpu_session/setup.sh || exit 1
PROFILE=${PROFILE:-docs/profiles/h200-queued.json}; echo "profile $PROFILE"
env | grep ^VRAMSHARD_ > $OUT/switches.txt; cat $OUT/switches.txt
timeout 400 python3 -m benchmarks.engine_bench --models nemo-8b --budgets 8,2 --deadline-s 360 \
  --profile $PROFILE --out $OUT/engine_nemo.json > $OUT/engine_nemo.log 2>&1; echo "rc $?"
grep -o '"[0-9]GiB_[a-z0-9_]*": [0-9.]*' $OUT/engine_nemo.json
