# ~2 min (run 2026-12-06 in session 44 as its call 3). The GPU test of the spared core alone (it failed in the
# suite of call 1), then qwen3-30b-a3b at 8 GiB: the host experts on the CPU (experts-cpu), read by the GPU's
# zero-copy kernels (experts-zero-copy), and shared between the two at the profile's balanced share and at
# 0.75 and 0.875 (experts-zero-copy-cpu), with the run-ahead worker (the default) and the planned cell.
source benchmarks/gpu_session/setup.sh || exit 1
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_moe.py -k leaves_the_planning -o log_cli=true \
  --log-cli-level=INFO > $OUT/sparing_test.txt 2>&1; echo "test rc $?"; tail -5 $OUT/sparing_test.txt
timeout 230 python3 -m benchmarks.moe_bench --budgets 8 --batches 1 --time-limit 190 --no-skewed --decode-steps 64 \
  --placements planned,experts-cpu,experts-zero-copy-cpu,experts-zero-copy --shares 0.75,0.875 --profile "$PROFILE" \
  --out $OUT/moe_shares.json > $OUT/moe_shares.log 2>&1; echo "moe rc $?"
grep -oE "'placement': '[^']*'|'decode_tok_s': [0-9.]*|'zero_copy_cpu_share': [0-9.]*|'bound_tok_s': [0-9.]*|'decode_step_ms': [0-9.]*" \
  $OUT/moe_shares.log | tr '\n' ' ' | sed 's/.placement/\n&/g'
