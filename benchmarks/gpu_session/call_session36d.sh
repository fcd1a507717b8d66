# ~9 min (written 2026-12-05 in session 35). The C kernel for routed experts on this host: one Qwen3-30B-A3B layer's
# experts at 1, 4 and 16 tokens against the compiled pass and the host's read (benchmarks/cpu_experts.py), then
# qwen3-30b-a3b at 8 GiB with run-ahead on: with the kernel, the zero-copy kernels alone, with the CPU's balanced
# share, the plan and experts on the CPU (`--cpu-moe`-style); without it, the plan and experts on the CPU.
source benchmarks/gpu_session/setup.sh || exit 1
timeout 90 python3 -m benchmarks.cpu_experts --rows 1,4,16 --threads-split 4 --repeat 10 --json $OUT/cpu_experts.json \
  > $OUT/cpu_experts.log 2>&1; echo "cpu_experts rc $?"; grep -E "'rows'" $OUT/cpu_experts.log | cut -c25-400
FIELDS="'placement': '[^']*'|'zero_copy_cpu_share': [0-9.]*|'decode_tok_s': [0-9.]*|'predicted_decode_tok_s': [0-9.]*|'bound_tok_s': [0-9.]*"
for GEMV in auto off; do
  if [ $GEMV = auto ]; then CELLS=experts-zero-copy,experts-zero-copy-cpu,planned,experts-cpu; LIMIT=230
  else CELLS=planned,experts-cpu; LIMIT=190; fi
  VRAMSHARD_CPU_GEMV=$GEMV VRAMSHARD_RUN_AHEAD=on timeout $LIMIT python3 -m benchmarks.moe_bench --budgets 8 --batches 1 \
    --time-limit $((LIMIT - 20)) --no-skewed --placements $CELLS --profile "${PROFILE:-docs/profiles/h200-run33.json}" \
    --out $OUT/moe_gemv_$GEMV.json > $OUT/moe_gemv_$GEMV.log 2>&1
  echo "moe (C kernel $GEMV) rc $?"
  grep -oE "$FIELDS" $OUT/moe_gemv_$GEMV.log | tr '\n' ' ' | sed 's/.placement/\n&/g'; echo
done
