# ~9 min (written 2026-12-05 in session 29): the twenty-sixth session measured nemo-8b decode at 8 GiB
# at 6.50 tok/s, level with layers:20, on a slow host (75 GB/s read); the fifteenth had 10.40. Session
# 28's down copies are the change in between: this runs them off and on (auto) in one call, then the
# prefix cache at 8 GiB (its benchmark failed at once in the twenty-sixth session, fixed since).
source benchmarks/gpu_session/setup.sh || exit 1
for copy in off auto; do
  VRAMSHARD_CPU_DOWN_COPY=$copy timeout 200 python3 -m benchmarks.engine_bench --models nemo-8b --budgets 8 \
    --batch-sizes 1 --deadline-s 150 --run-limit-s 15 --profile ${PROFILE:-docs/profiles/h200-run26b.json} \
    --out $OUT/nemo_decode_copy_$copy.json > $OUT/nemo_decode_copy_$copy.log 2>&1; echo "down copy $copy rc $?"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d.get('bandwidth_gb_s')); [print(c.get('engine'), c.get('vram'), c.get('tg_tok_s'), c.get('decode_host_compute_ms_median'), c.get('error','')) for m in d['models'].values() for c in m['cells']]" $OUT/nemo_decode_copy_$copy.json 2>&1 | tail -5
done
timeout 130 python3 -m benchmarks.prefix_cache --shape llama3-8b --vram 8 --turns 3 --system 2048 --message 128 \
  --answer 16 --ctx 4096 --batch 4 --profile docs/profiles/h200-run26b.json --json $OUT/prefix_cache_8gib.json > $OUT/prefix_cache_8gib.log 2>&1
echo "prefix cache rc $?"; grep -E "^turn|prompts at once|different|Error" $OUT/prefix_cache_8gib.log | cut -c1-200
