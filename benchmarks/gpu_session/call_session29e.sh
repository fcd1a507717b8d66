# ~9 min (written 2026-12-05 in session 29): nemo-8b decode at 8 and 2 GiB (the Planner issue's 12.4 and
# 7.6 tok/s), planned from h200-run26b.json, as a user gets it (run-ahead off, no prepacking: split FFNs'
# CPU parts read row-major down copies since session 28), then with the run-ahead worker on.
source benchmarks/gpu_session/setup.sh || exit 1
for ahead in off on; do
  VRAMSHARD_RUN_AHEAD=$ahead timeout 265 python3 -m benchmarks.engine_bench --models nemo-8b \
    --budgets 8,2 --batch-sizes 1 --deadline-s 200 --run-limit-s 15 --profile ${PROFILE:-docs/profiles/h200-run26b.json} \
    --out $OUT/nemo_decode_ahead_$ahead.json > $OUT/nemo_decode_ahead_$ahead.log 2>&1; echo "ahead=$ahead rc $?"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(c.get('engine'), c.get('vram'), c.get('tg_tok_s'), c.get('ttft_s'), c.get('error','')) for m in d['models'].values() for c in m['cells']]" $OUT/nemo_decode_ahead_$ahead.json 2>&1 | tail -8
done
