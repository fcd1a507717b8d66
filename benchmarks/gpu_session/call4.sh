# ~9 min: qwen3-30b-a3b at 8 and 16 GiB with the experts-zero-copy cell (and the planner's plan
# reading host experts by the GPU too), against layers:max and experts-cpu, and the bound.
source benchmarks/gpu_session/setup.sh || exit 1
export VRAMSHARD_EXPERTS_ZERO_COPY=on
timeout 560 python3 -m benchmarks.moe_bench --budgets 8,16 --batches 1,64 --time-limit 400 \
  --placements planned,experts-stream-zero-copy,experts-zero-copy,experts-cpu,layers:max,experts-stream \
  --profile docs/profiles/h200-queued.json --out $OUT/moe_bench.json > $OUT/moe_bench.log 2>&1; echo "rc $?"
python3 - <<'PY'
import json, os
d = json.load(open(os.path.join(os.environ["OUT"], "moe_bench.json")))
for c in d["cells"]:
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in c.items()
           if k in ("placement", "budget_gib", "decode_tok_s", "bound_tok_s", "decode_fraction_of_bound",
                    "ttft_s", "batched_tok_s", "peak_vram_gib", "within_budget", "error")})
PY
