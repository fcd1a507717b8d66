# ~8 min: the 3x cell (llama3-8b batch 64 at 8 GiB, medians of three) with and without prepacked
# CPU weights, planned from PROFILE; then an 8-layer qwen3-30b-a3b decode step with the CPU's share
# beside the zero-copy kernels on the run-ahead worker at shares 0.2, 0.315 and 0.45 (the sixteenth
# session: 0.315 beat the kernels alone by 6% in the step; the engine at the balanced 0.556 lost).
source benchmarks/gpu_session/setup.sh || exit 1
PROFILE=${PROFILE:-docs/profiles/h200-run15.json}; echo "profile $PROFILE"
for packed in off on; do
  VRAMSHARD_CPU_PACKED=$packed timeout 170 python3 -m benchmarks.engine_bench --models llama3-8b --budgets 8 \
    --batch-sizes 64 --repeat 3 --profile $PROFILE --out $OUT/engine_llama_b64_$packed.json >> $OUT/engine_llama_b64.log 2>&1
  echo "packed $packed"; grep -o '"8GiB_batch64[a-z0-9_]*": [0-9.]*' $OUT/engine_llama_b64_$packed.json
done
timeout 110 python3 -m benchmarks.step_profile --shape qwen3-30b-a3b --layers 8 --steps 6 --rows 25 \
  --placements experts-cpu+zerocopy,experts-cpu+zerocopy+ahead+share=0.2,experts-cpu+zerocopy+ahead+share=0.315,experts-cpu+zerocopy+ahead+share=0.45 \
  --profile $PROFILE > $OUT/moe_share_steps.log 2>&1
grep "'placement'" $OUT/moe_share_steps.log | cut -c25-520
