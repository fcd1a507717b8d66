# ~9.5 min on a FRESH machine (written 2026-12-05 in session 27, changed in session 28, before any GPU
# session ran it). The planned MoE share decoded at 15.99 tok/s on one machine and 12.66 on another
# (kernels alone 12.62 and 12.45), and the worker's part of a layer cost ~1 ms for 3 or 4 experts, about
# 3x the pass alone (2.3x in the profile's timing beside Python, at one core fewer).
# 1. Two alternating pairs (kernels alone, planned) on one boot, with the worker's parts per step
#    (decode_worker_*: the expert pass's compiled call against the part's whole computing, the team).
# 2. worker_team: the expert pass and a dense part alone and beside Python, by the worker's OpenMP team
#    (15, 12, 8, 4 threads): is a smaller team faster beside the busy host thread?
# 3. The planned share again with the team step 2 found fastest for the expert pass beside Python
#    (VRAMSHARD_WORKER_THREADS), and the kernels alone beside it.
source benchmarks/gpu_session/setup.sh || exit 1
VRAMSHARD_RUN_AHEAD=on timeout 220 python3 -m benchmarks.moe_bench --budgets 8 --batches 1 --time-limit 200 --no-skewed \
  --placements experts-zero-copy,planned,experts-zero-copy,planned \
  --profile docs/profiles/h200-run26b.json --out $OUT/moe_repeats.json > $OUT/moe_repeats.log 2>&1; echo "moe rc $?"
FIELDS="'placement': '[^']*'|'decode_tok_s': [0-9.]*|'decode_step_ms': [0-9.]*|'decode_host_compute_ms': [0-9.]*|'decode_worker_longest_part_ms': [0-9.]*|'decode_worker_expert_kernel_ms': [0-9.]*|'decode_worker_team': [0-9]*"
grep -oE "$FIELDS" $OUT/moe_repeats.log | tr '\n' ' ' | sed 's/.placement/\n&/g'
timeout 150 python3 -m benchmarks.worker_team --json $OUT/worker_team.json > $OUT/worker_team.log 2>&1; echo "team rc $?"
grep -E "team +[0-9]+:" $OUT/worker_team.log | cut -c1-200
TEAM=$(python3 -c "import json; c=[c for c in json.load(open('$OUT/worker_team.json'))['cells'] if c['work'].startswith('experts')]; print(min(c, key=lambda c: c['beside_python_ms'])['team'])" 2>/dev/null || echo 8)
echo "fastest team beside Python for the expert pass: $TEAM"
python3 -c "import json; c=[c for c in json.load(open('$OUT/worker_team.json'))['cells'] if c['work'] == 'dense part 64 rows']; print('for the dense part at 64 rows (TEAM for call_session28c.sh):', min(c, key=lambda c: c['beside_python_ms'])['team'])" 2>&1 | tail -1
VRAMSHARD_WORKER_THREADS=$TEAM VRAMSHARD_RUN_AHEAD=on timeout 170 python3 -m benchmarks.moe_bench --budgets 8 --batches 1 \
  --time-limit 150 --no-skewed --placements planned,experts-zero-copy \
  --profile docs/profiles/h200-run26b.json --out $OUT/moe_team.json > $OUT/moe_team.log 2>&1; echo "moe team rc $?"
grep -oE "$FIELDS" $OUT/moe_team.log | tr '\n' ' ' | sed 's/.placement/\n&/g'
