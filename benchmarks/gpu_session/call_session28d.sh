# ~9 min (written 2026-12-05 in session 28; it was 28c). The Engine issue's last cell: llama3-8b batch 64 at 8 GiB
# must reach 3x layers:max (2.41-2.98x so far; 2.49x in the eighteenth session). The planned step at
# 64 rows is its CPU parts (~98 ms) beside its copies (~100 ms) plus ~26 ms of host time; run-ahead
# takes the host time off the critical path but its worker's parts ran 1.5x slower (fourteenth
# session). Run after call_session28c.sh, with TEAM set to the team worker_team found fastest for the
# dense part at 64 rows beside Python (e.g. TEAM=8 bash ...): the same cell with run-ahead and prepacked
# weights, with the worker's default team (one core fewer), then with TEAM, each beside layers:max.
source benchmarks/gpu_session/setup.sh || exit 1
TEAM=${TEAM:-8}
for team in default $TEAM; do
  if [ "$team" = default ]; then unset VRAMSHARD_WORKER_THREADS; else export VRAMSHARD_WORKER_THREADS=$team; fi
  VRAMSHARD_RUN_AHEAD=on VRAMSHARD_CPU_PACKED=on timeout 260 python3 -m benchmarks.engine_bench --models llama3-8b \
    --budgets 8 --batch-sizes 1,64 --deadline-s 200 --run-limit-s 20 --profile ${PROFILE:-docs/profiles/h200-run26b.json} \
    --out $OUT/llama_b64_team_$team.json > $OUT/llama_b64_team_$team.log 2>&1; echo "team $team rc $?"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(c.get('engine'), c.get('vram'), c.get('tg_tok_s'), {b: round(v['tok_s'], 1) for b, v in c.get('batched', {}).items()}, c.get('error', '')) for m in d['models'].values() for c in m['cells']]; [print(m.get('checks')) for m in d['models'].values()]" $OUT/llama_b64_team_$team.json 2>&1 | tail -8
  grep -iE "error|Traceback" $OUT/llama_b64_team_$team.log | head -3
done
