# ~1 min each (run 2026-12-06 in session 44 as its calls 4 and 5). qwen3-30b-a3b at 8 GiB: the expert cache with
# the CPU computing the profile's share of each decode step's misses (experts-hybrid) against experts-cpu, the
# cache alone (experts-stream) and the zero-copy share. ZERO_COPY=off (call 5; VRAMSHARD_EXPERTS_ZERO_COPY) keeps
# decode steps off the zero-copy kernels, which otherwise read the cache's misses and leave the hybrid unused.
source benchmarks/gpu_session/setup.sh || exit 1
if [ "${ZERO_COPY:-}" = off ]; then
  VRAMSHARD_EXPERTS_ZERO_COPY=off timeout 150 python3 -m benchmarks.moe_bench --budgets 8 --batches 1 --time-limit 110 \
    --no-skewed --decode-steps 64 --placements experts-hybrid,experts-cpu,experts-stream --profile "$PROFILE" \
    --out $OUT/moe_hybrid_nozc.json > $OUT/moe_hybrid_nozc.log 2>&1; echo "moe rc $?"
else
  timeout 200 python3 -m benchmarks.moe_bench --budgets 8 --batches 1 --time-limit 160 --no-skewed --decode-steps 64 \
    --placements experts-hybrid,experts-cpu,experts-stream,experts-zero-copy-cpu --profile "$PROFILE" \
    --out $OUT/moe_hybrid.json > $OUT/moe_hybrid.log 2>&1; echo "moe rc $?"
fi
