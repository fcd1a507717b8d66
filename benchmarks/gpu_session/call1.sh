# ~8.5 min on a fresh machine: GPU tests (the shared-streams test, zero-copy on by default); the
# CPU's compiled pass over a layer's routed experts against the expert-by-expert path (cpu_experts);
# then qwen3-30b-a3b at 8 and 16 GiB, the planned engine (zero-copy experts) against layers:max and
# experts computed by the CPU (now in the compiled pass), and the kernels with a CPU share beside
# them, with each cell's VRAM reserved before its executor (before_gib: it should now stay near 0,
# not grow by 32 MiB an executor) and the skewed cell inside its budget.
source benchmarks/gpu_session/setup.sh || exit 1
timeout 200 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=10 > $OUT/pytest_gpu.txt 2>&1; tail -3 $OUT/pytest_gpu.txt
grep -E "^(FAILED|ERROR)" $OUT/pytest_gpu.txt | cut -c1-250
timeout 70 python3 -m benchmarks.cpu_experts --rows 1,4 --threads-split 2 --repeat 10 --json $OUT/cpu_experts.json \
  > $OUT/cpu_experts.log 2>&1; echo "cpu_experts rc $?"; grep -o "{'rows.*" $OUT/cpu_experts.log | cut -c1-400
timeout 250 python3 -m benchmarks.moe_bench --budgets 8,16 --batches 1,64 --time-limit 220 \
  --placements planned,experts-zero-copy,experts-zero-copy-cpu,experts-cpu,layers:max \
  --profile docs/profiles/h200-queued.json --out $OUT/moe_bench.json > $OUT/moe_bench.log 2>&1; echo "rc $?"
python3 - <<'PY'
import json, os
d = json.load(open(os.path.join(os.environ["OUT"], "moe_bench.json")))
for c in d["cells"] + [d.get("skewed") or {}]:
    before = {k: round(v.get("before_gib", 0), 3) for k, v in c.get("peak_by_phase", {}).items()}
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in c.items()
           if k in ("placement", "budget_gib", "decode_tok_s", "predicted_decode_tok_s", "bound_tok_s", "pcie_bound_tok_s", "ttft_s",
                    "batched_tok_s", "peak_vram_gib", "within_budget", "error")}, "before", before)
PY
