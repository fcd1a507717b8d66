# ~4.5 min (written 2026-12-05 in session 27, for the session's last 276 s of device time): nemo-8b decode
# at 8 GiB (the Planner issue's 12.4 tok/s; 10.40 in the fifteenth session without run-ahead) with the
# run-ahead worker on, planned from h200-run26b.json, beside layers:max and the unconstrained engine.
source benchmarks/gpu_session/setup.sh || exit 1
VRAMSHARD_RUN_AHEAD=on VRAMSHARD_CPU_PACKED=on timeout 230 python3 -m benchmarks.engine_bench --models nemo-8b \
  --budgets 8 --batch-sizes 1 --deadline-s 110 --run-limit-s 12 --profile docs/profiles/h200-run26b.json \
  --out $OUT/nemo_decode_ahead_on.json > $OUT/nemo_decode_ahead_on.log 2>&1; echo "rc $?"
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(c.get('engine'), c.get('vram'), c.get('tg_tok_s'), c.get('ttft_s'), c.get('error','')) for m in d['models'].values() for c in m['cells']]" $OUT/nemo_decode_ahead_on.json 2>&1 | tail -8
grep -iE "error|Traceback" $OUT/nemo_decode_ahead_on.log | head -5
