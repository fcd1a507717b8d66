# ~8 min: GPU tests; the llama3-8b 3x cell (batch 64 at 8 GiB, medians of three) with run-ahead
# and prepacked weights; qwen3-30b-a3b's planned engine at 8 GiB (zero-copy on by default).
source benchmarks/gpu_session/setup.sh || exit 1
timeout 190 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=5 > $OUT/pytest_gpu.txt 2>&1; tail -3 $OUT/pytest_gpu.txt
grep -E "^(FAILED|ERROR)" $OUT/pytest_gpu.txt | cut -c1-250
VRAMSHARD_RUN_AHEAD=on VRAMSHARD_CPU_PACKED=on timeout 190 python3 -m benchmarks.engine_bench --models llama3-8b --budgets 8 \
  --batch-sizes 64 --repeat 3 --profile docs/profiles/h200-queued.json --out $OUT/engine_llama_r3.json > $OUT/run.log 2>&1
grep -o '"8GiB_batch64[a-z0-9_]*": [0-9.]*' $OUT/engine_llama_r3.json
timeout 110 python3 -m benchmarks.moe_bench --budgets 8 --batches 1 --time-limit 60 --placements planned \
  --profile docs/profiles/h200-queued.json --out $OUT/moe_bench.json >> $OUT/run.log 2>&1; echo "rc $?"
python3 - <<'PY'
import json, os
d = json.load(open(os.path.join(os.environ["OUT"], "moe_bench.json")))
for c in d["cells"]:
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in c.items()
           if k in ("placement", "name", "decode_tok_s", "bound_tok_s", "pcie_bound_tok_s", "ttft_s", "batched_tok_s",
                    "peak_vram_gib", "within_budget", "error")})
PY
