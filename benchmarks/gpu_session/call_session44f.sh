# ~4 min (written 2026-12-06 in session 44). qwen3-30b-a3b at 8 GiB, planned and experts-cpu, with the resident
# attention layers' CUDA graphs (moe_bench --decode-graphs, an Engine's default) and without (every moe_bench run
# until session 44), alternating, one process each. The thirty-ninth session's steps spent 12-21 ms beyond the
# worker's expert kernel, most of it the GPU's part of 48 layers' round trips (decode_host_wait_ms); graphs replay
# each attention as one launch. Compare each pair's decode_tok_s and decode_host_wait_ms; "decode_graphs" in the
# JSON counts the replays (none: the graphs were not used, and why).
source benchmarks/gpu_session/setup.sh || exit 1
i=0
for graphs in ${GRAPHS:-on off on off}; do
  i=$((i + 1))
  flag="--no-decode-graphs"; [ "$graphs" = on ] && flag="--decode-graphs"
  timeout 85 python3 -m benchmarks.moe_bench --budgets 8 --batches 1 --time-limit 65 --no-skewed --decode-steps 64 \
    --placements planned,experts-cpu --profile "$PROFILE" $flag --out $OUT/moe_graphs_${graphs}_$i.json \
    > $OUT/moe_graphs_${graphs}_$i.log 2>&1
  echo "graphs $graphs rc $? load $(cut -d' ' -f1-3 /proc/loadavg)"
  grep -oE "'placement': '[^']*'|'decode_tok_s': [0-9.]*|'decode_step_ms': [0-9.]*|'decode_host_wait_ms': [0-9.]*|'decode_graphs': [^}]*}" \
    $OUT/moe_graphs_${graphs}_$i.log | tr '\n' ' ' | sed 's/.placement/\n&/g'; echo
done
