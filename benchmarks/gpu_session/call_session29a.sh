# ~9.5 min (written 2026-12-05 in session 29). 1. benchmarks.cpu_layouts (the CPU down product by
# layout, the host experts pass in both forms; moved here from call_session28c.sh). 2. Qwen1.5-MoE-A2.7B
# (bf16, random weights; a gated shared expert of 5632 beside 60 experts of 1408, 4 routed), new in
# session 29: at 2 GiB the plan splits 18 of 24 MoE layers at their experts (their shared experts in
# VRAM) and runs the rest whole; at 8 GiB all split. Decode at 1K context and batch 1/16 against
# layers:max and experts-cpu, run-ahead on. PROFILE=<a profile of this machine> to plan from it.
source benchmarks/gpu_session/setup.sh || exit 1
timeout 120 python3 -m benchmarks.cpu_layouts --json $OUT/cpu_layouts.json > $OUT/cpu_layouts.log 2>&1; echo "layouts rc $?"
grep -E "^(down|experts)" $OUT/cpu_layouts.log | cut -c1-160
PROFILE=${PROFILE:-docs/profiles/h200-run26b.json}
VRAMSHARD_RUN_AHEAD=on timeout 400 python3 -m benchmarks.moe_bench --shape qwen1.5-moe-a2.7b --budgets 2,8 --batches 1,16 \
  --time-limit 380 --no-skewed --placements planned,layers:max,experts-cpu --profile $PROFILE \
  --out $OUT/moe_qwen15.json > $OUT/moe_qwen15.log 2>&1; echo "moe rc $?"
FIELDS="'placement': '[^']*'|'budget_gib': [0-9.]*|'decode_tok_s': [0-9.]*|'predicted_decode_tok_s': [0-9.]*|'bound_tok_s': [0-9.]*|'ttft_s': [0-9.]*|'peak_vram_gib': [0-9.]*|'error': '[^']*'"
grep -oE "$FIELDS" $OUT/moe_qwen15.log | tr '\n' ' ' | sed 's/.placement/\n&/g'
