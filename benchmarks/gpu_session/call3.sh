# ~9 min: the GPU tests with the time they need (the sixteenth session's call 1 cut them at 220 s),
# then qwen3-30b-a3b at 8 GiB: the planned engine, the zero-copy kernels with and without the CPU's
# share, and the experts on the CPU, planned from PROFILE; last, where an 8-layer step of the kernels
# with and without the share spends its host time (torch.profiler: is the host blocked on the
# router's copies or on the share's result?).
source benchmarks/gpu_session/setup.sh || exit 1
PROFILE=${PROFILE:-docs/profiles/h200-run15.json}; echo "profile $PROFILE"
timeout 300 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=15 > $OUT/pytest_gpu.txt 2>&1; tail -20 $OUT/pytest_gpu.txt
grep -E "^(FAILED|ERROR)" $OUT/pytest_gpu.txt | cut -c1-250
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
timeout 90 python3 -m benchmarks.step_profile --shape qwen3-30b-a3b --layers 8 --steps 6 --rows 25 \
  --placements experts-cpu+zerocopy,experts-cpu+zerocopy+share=0.315 --profile $PROFILE > $OUT/moe_share_steps.log 2>&1
grep "'placement'" $OUT/moe_share_steps.log | cut -c25-520
