# ~9.5 min on a fresh machine (written 2026-12-05 in session 31). 1. The whole GPU suite on session 30's
# and 31's tree (exact-size pinned host buffers back every engine's host weights; not yet run whole).
# Since session 31 CPU parts are prepacked by default beside a GPU (VRAMSHARD_CPU_PACKED=auto): the suite
# runs with that. 2. nemo-8b at 8 GiB, the default (prepacked, no down copies beside them), with the
# engine's load timeline (Engine.load_seconds, session 31): where the 63-125 s between two engines go.
source benchmarks/gpu_session/setup.sh || exit 1
timeout 370 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=10 > $OUT/pytest_gpu.txt 2>&1; echo "suite rc $?"
tail -3 $OUT/pytest_gpu.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest_gpu.txt | cut -c1-250
timeout 175 python3 -m benchmarks.engine_bench --models nemo-8b --budgets 8 --batch-sizes 1 \
  --deadline-s 100 --run-limit-s 12 --profile ${PROFILE:-docs/profiles/h200-run26b.json} \
  --out $OUT/nemo_decode_packed.json > $OUT/nemo_decode_packed.log 2>&1; echo "nemo rc $?"
python3 benchmarks/gpu_session/engine_summary.py $OUT/nemo_decode_packed.json 2>&1 | tail -4
grep -E "took \{1:|loaded " $OUT/nemo_decode_packed.log | cut -c1-330 | head -4
