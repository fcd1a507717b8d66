# Sourced by the calls: engine_grid MODEL BUDGETS DEADLINE_S TIMEOUT_S runs benchmarks.engine_bench
# for MODEL at BUDGETS (GiB, comma-separated) planned from PROFILE into $OUT/engine_MODEL.json, with
# the switches in force, then prints its checks and the log's calibrations and graph fallbacks.
engine_grid() {
  local model=$1 budgets=$2 deadline=$3 limit=$4 name=${1%%-*}
  PROFILE=${PROFILE:-docs/profiles/h200-run15.json}; echo "profile $PROFILE"
  env | grep ^VRAMSHARD_ > $OUT/switches.txt; cat $OUT/switches.txt
  timeout $limit python3 -m benchmarks.engine_bench --models $model --budgets $budgets --deadline-s $deadline \
    --profile $PROFILE --out $OUT/engine_$name.json > $OUT/engine_$name.log 2>&1; echo "rc $?"
  grep -o '"[0-9]GiB_[a-z0-9_]*": [0-9.]*' $OUT/engine_$name.json
  grep -E "took|fitted|not fitted|memory limit" $OUT/engine_$name.log | cut -c1-260
}
