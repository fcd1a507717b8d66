# ~5 min (written 2026-12-05 in session 29): qwen3-30b-a3b at 8 GiB with run-ahead on, the kernels alone
# against the plan (session 28's host experts pass and worker team, not yet measured), then the prefix
# cache on llama3-8b at 2 GiB (3 turns from a 2048-token prompt).
source benchmarks/gpu_session/setup.sh || exit 1
VRAMSHARD_RUN_AHEAD=on timeout 180 python3 -m benchmarks.moe_bench --budgets 8 --batches 1 --time-limit 160 --no-skewed \
  --placements experts-zero-copy,planned --profile docs/profiles/h200-run26b.json --out $OUT/moe_planned.json > $OUT/moe_planned.log 2>&1; echo "moe rc $?"
FIELDS="'placement': '[^']*'|'zero_copy_cpu_share': [0-9.]*|'decode_tok_s': [0-9.]*|'predicted_decode_tok_s': [0-9.]*|'bound_tok_s': [0-9.]*|'decode_worker_team': [0-9]*"
grep -oE "$FIELDS" $OUT/moe_planned.log | tr '\n' ' ' | sed 's/.placement/\n&/g'
timeout 110 python3 -m benchmarks.prefix_cache --shape llama3-8b --vram 2 --turns 3 --system 2048 --message 128 \
  --answer 16 --ctx 4096 --profile docs/profiles/h200-run26b.json --json $OUT/prefix_cache_2gib.json > $OUT/prefix_cache_2gib.log 2>&1
echo "prefix cache rc $?"; grep -E "^turn|different|Error" $OUT/prefix_cache_2gib.log | cut -c1-200
