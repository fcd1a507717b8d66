# ~8 min (written 2026-12-06 in session 45). The KV cache split by layer (VRAMSHARD_KV_SPLIT) against the
# whole cache: llama3-8b at 4 GiB with a 4K prompt (the planner splits it there: 26 of 32 layers' caches in VRAM
# on the H100 profile), off and on alternating, one engine_bench process each (the unconstrained engine,
# layers:max and the planned one). Compare the planned cells' tg_tok_s and b1, and the log's "KV cache" line.
source benchmarks/gpu_session/setup.sh || exit 1
i=0
for kv in ${KV_SPLITS:-off on off on}; do
  i=$((i + 1))
  VRAMSHARD_KV_SPLIT=$kv engine_step llama8_kvsplit_${kv}_$i 115 --models llama3-8b --budgets 4 --pp 4096 --tg 32 \
    --batch-sizes 1 --repeat 1 --deadline-s 95 --run-limit-s 8
  grep -E "took|reconfigured" $OUT/llama8_kvsplit_${kv}_$i.log | cut -c1-200 | head -3
done
