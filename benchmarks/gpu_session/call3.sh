# ~8 min: the 3x cell (llama3-8b batch 64 at 8 GiB, medians of three) with and without prepacked CPU
# weights, then qwen3-30b-a3b at 8 GiB: the planned engine, the zero-copy kernels with and without
# the CPU's share, and the experts on the CPU, planned from PROFILE; last, where an 8-layer step of
# the kernels with and without the share spends its host time (torch.profiler: is the host blocked
# on the router's copies or on the share's result?).
source benchmarks/gpu_session/setup.sh || exit 1
PROFILE=${PROFILE:-docs/profiles/h200-run15.json}; echo "profile $PROFILE"
for packed in off on; do
  VRAMSHARD_CPU_PACKED=$packed timeout 170 python3 -m benchmarks.engine_bench --models llama3-8b --budgets 8 \
    --batch-sizes 64 --repeat 3 --profile $PROFILE --out $OUT/engine_llama_b64_$packed.json >> $OUT/engine_llama_b64.log 2>&1
  echo "packed $packed"; grep -o '"8GiB_batch64[a-z0-9_]*": [0-9.]*' $OUT/engine_llama_b64_$packed.json
done
timeout 130 python3 -m benchmarks.moe_bench --budgets 8 --batches 1 --time-limit 110 \
  --placements planned,experts-zero-copy,experts-zero-copy-cpu,experts-cpu \
  --profile $PROFILE --out $OUT/moe_bench.json > /dev/null 2>&1; echo "rc $?"
python3 - <<'PY'
import json, os
d = json.load(open(os.path.join(os.environ["OUT"], "moe_bench.json")))
for c in d["cells"]:
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in c.items()
           if k in ("placement", "decode_tok_s", "predicted_decode_tok_s", "bound_tok_s", "pcie_bound_tok_s",
                    "peak_vram_gib", "within_budget", "error")})
PY
timeout 100 python3 -m benchmarks.step_profile --shape qwen3-30b-a3b --layers 8 --steps 6 --rows 25 \
  --placements experts-cpu+zerocopy,experts-cpu+zerocopy+share=0.315 --profile $PROFILE > $OUT/moe_share_steps.log 2>&1
grep "'placement'" $OUT/moe_share_steps.log | cut -c25-520
