# ~8.5 min: the llama3-8b engine grid and the 3x cell as medians of three. Prefix the switches
# that call 1 showed faster, e.g. `VRAMSHARD_CPU_PACKED=on VRAMSHARD_RUN_AHEAD=on bash ...`, and
# PROFILE=docs/profiles/<file> for a profile other than h200-queued.json (call 2's, which has the
# prepacked FFN factors that the planner needs to plan for VRAMSHARD_CPU_PACKED).
source benchmarks/gpu_session/setup.sh || exit 1
PROFILE=${PROFILE:-docs/profiles/h200-queued.json}; echo "profile $PROFILE"
env | grep ^VRAMSHARD_ > $OUT/switches.txt; cat $OUT/switches.txt
timeout 300 python3 -m benchmarks.engine_bench --models llama3-8b --budgets 8,2 --compile --deadline-s 270 \
  --profile $PROFILE --out $OUT/engine_llama.json > $OUT/engine_llama.log 2>&1
grep -o '"[0-9]GiB_[a-z0-9_]*": [0-9.]*' $OUT/engine_llama.json
timeout 200 python3 -m benchmarks.engine_bench --models llama3-8b --budgets 8 --batch-sizes 64 --repeat 3 \
  --profile $PROFILE --out $OUT/engine_llama_r3.json > $OUT/engine_llama_r3.log 2>&1
grep -o '"8GiB_batch64[a-z0-9_]*": [0-9.]*' $OUT/engine_llama_r3.json
