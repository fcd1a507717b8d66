# ~9.5 min (written 2026-12-05 in session 28; session 29 moved cpu_layouts to call_session29a.sh): the
# whole GPU suite (session 28 changed the run-ahead worker's team, the plan's worker_threads and the
# host experts pass; session 29 added Qwen2-MoE, ~25 more GPU tests), then benchmarks.worker_team:
# the expert pass and a dense part alone and beside Python by the worker's team (15/12/8/4 threads),
# the largest team also with the Python thread and the team on separate cores.
source benchmarks/gpu_session/setup.sh || exit 1
timeout 400 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=10 > $OUT/pytest_gpu.txt 2>&1; tail -3 $OUT/pytest_gpu.txt
grep -E "^(FAILED|ERROR)" $OUT/pytest_gpu.txt | cut -c1-250
timeout 150 python3 -m benchmarks.worker_team --json $OUT/worker_team.json > $OUT/worker_team.log 2>&1; echo "team rc $?"
grep -E "team +[0-9]+:" $OUT/worker_team.log | cut -c1-220
python3 -c "import json; c=json.load(open('$OUT/worker_team.json'))['cells']; [print(w, 'fastest team beside Python:', min((x for x in c if x['work'] == w), key=lambda x: x['beside_python_ms'])['team']) for w in dict.fromkeys(x['work'] for x in c)]" 2>&1 | tail -3
