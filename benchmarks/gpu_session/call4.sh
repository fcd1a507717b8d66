# ~5 min: the CPU's share beside the zero-copy kernels on the run-ahead worker (the host queuing on
# instead of computing it): its GPU tests, an 8-layer qwen3-30b-a3b decode step with the share on
# the host thread and on the worker (and the compiled experts pass on the worker), then moe_bench at
# 8 GiB with run-ahead: the kernels alone against the kernels and the worker's share.
source benchmarks/gpu_session/setup.sh || exit 1
PROFILE=${PROFILE:-docs/profiles/h200-run15.json}; echo "profile $PROFILE"
timeout 80 python3 -m pytest -m gpu -q -rs -p no:cacheprovider -k "shared_between or run_ahead" tests/test_moe.py \
  > $OUT/pytest_gpu.txt 2>&1; tail -3 $OUT/pytest_gpu.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest_gpu.txt | cut -c1-250
timeout 100 python3 -m benchmarks.step_profile --shape qwen3-30b-a3b --layers 8 --steps 6 --rows 25 \
  --placements experts-cpu+zerocopy,experts-cpu+zerocopy+share=0.315,experts-cpu+zerocopy+ahead+share=0.315,experts-cpu+ahead \
  --profile $PROFILE > $OUT/moe_share_steps.log 2>&1
grep "'placement'" $OUT/moe_share_steps.log | cut -c25-520
VRAMSHARD_RUN_AHEAD=on timeout 125 python3 -m benchmarks.moe_bench --budgets 8 --batches 1 --time-limit 100 \
  --placements experts-zero-copy,experts-zero-copy-cpu --profile $PROFILE --out $OUT/moe_bench_ahead.json > /dev/null 2>&1; echo "rc $?"
python3 - <<'PY'
import json, os
d = json.load(open(os.path.join(os.environ["OUT"], "moe_bench_ahead.json")))
for c in d["cells"]:
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in c.items()
           if k in ("placement", "decode_tok_s", "predicted_decode_tok_s", "bound_tok_s", "pcie_bound_tok_s",
                    "peak_vram_gib", "within_budget", "error")})
PY
