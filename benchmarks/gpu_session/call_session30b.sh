# ~9.5 min on a fresh machine (written 2026-12-05 in session 30). The fifteenth session decoded nemo-8b at
# 8 GiB at 10.40 tok/s with prepacked CPU parts; the twenty-sixth at 6.50 without them (row-major down
# copies since session 28) on a slow host. One process per way, one after another on one boot, run-ahead
# off (the default): prepacked (VRAMSHARD_CPU_PACKED=on), the default (down copies auto), down copies off.
# Then the prefix cache at 8 GiB (llama3-8b), if time is left.
source benchmarks/gpu_session/setup.sh || exit 1
for way in packed auto off; do
  if [ $way = packed ]; then export VRAMSHARD_CPU_PACKED=on VRAMSHARD_CPU_DOWN_COPY=auto
  else export VRAMSHARD_CPU_PACKED=off VRAMSHARD_CPU_DOWN_COPY=$way; fi
  timeout 165 python3 -m benchmarks.engine_bench --models nemo-8b --budgets 8 --batch-sizes 1 --deadline-s 100 \
    --run-limit-s 12 --profile ${PROFILE:-docs/profiles/h200-run26b.json} \
    --out $OUT/nemo_decode_$way.json > $OUT/nemo_decode_$way.log 2>&1; echo "$way rc $?"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d.get('bandwidth_gb_s')); [print(c.get('engine'), c.get('vram'), c.get('tg_tok_s'), c.get('decode_host_compute_ms_median'), c.get('error','')) for m in d['models'].values() for c in m['cells']]" $OUT/nemo_decode_$way.json 2>&1 | tail -4
  grep -E "took \{1:" $OUT/nemo_decode_$way.log | cut -c1-330 | head -2
done
unset VRAMSHARD_CPU_PACKED VRAMSHARD_CPU_DOWN_COPY
timeout 75 python3 -m benchmarks.prefix_cache --shape llama3-8b --vram 8 --turns 3 --system 2048 --message 128 \
  --answer 16 --ctx 4096 --profile docs/profiles/h200-run26b.json --json $OUT/prefix_cache_8gib.json > $OUT/prefix_cache_8gib.log 2>&1
echo "prefix cache rc $?"; grep -E "^turn|different|Error" $OUT/prefix_cache_8gib.log | cut -c1-200
