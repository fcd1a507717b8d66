# ~7 min: GPU tests; a MoE layer's experts on the CPU a few ways; MoE steps with the CPU's share
# beside the zero-copy kernels; qwen3-30b-a3b at 8 GiB with that share against the baselines.
source benchmarks/gpu_session/setup.sh || exit 1
timeout 200 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=10 > $OUT/pytest_gpu.txt 2>&1; tail -3 $OUT/pytest_gpu.txt
grep -E "^(FAILED|ERROR)" $OUT/pytest_gpu.txt | cut -c1-250
timeout 60 python3 -m benchmarks.cpu_experts --json $OUT/cpu_experts.json > $OUT/run.log 2>&1; echo "rc $?"
grep -E "'rows'|Error" $OUT/run.log | cut -c25-600
timeout 100 python3 -m benchmarks.step_profile --shape qwen3-30b-a3b --layers 8 --steps 4 \
  --placements experts-cpu+zerocopy,experts-cpu+zerocopy+share,experts-cpu+zerocopy+share=0.2,experts-cpu+zerocopy+share=0.4 \
  --profile docs/profiles/h200-queued.json --json $OUT/moe_steps.json >> $OUT/run.log 2>&1; echo "rc $?"
grep -E "'placement'|failed|Error" $OUT/run.log | cut -c25-330
timeout 200 python3 -m benchmarks.moe_bench --budgets 8 --batches 1,64 --time-limit 170 \
  --placements planned,experts-zero-copy-cpu,experts-zero-copy,experts-cpu,layers:max \
  --profile docs/profiles/h200-queued.json --out $OUT/moe_bench.json >> $OUT/run.log 2>&1; echo "rc $?"
python3 - <<'PY'
import json, os
d = json.load(open(os.path.join(os.environ["OUT"], "moe_bench.json")))
for c in d["cells"]:
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in c.items()
           if k in ("placement", "budget_gib", "decode_tok_s", "bound_tok_s", "pcie_bound_tok_s", "decode_fraction_of_bound",
                    "ttft_s", "batched_tok_s", "peak_vram_gib", "within_budget", "zero_copy_cpu_share", "error")})
PY
