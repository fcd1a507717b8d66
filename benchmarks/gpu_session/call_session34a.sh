# ~5 min on a fresh machine (written 2026-12-05 in session 33). The whole GPU suite after session 33's
# changes: prompt chunks compute split FFNs' CPU parts plain (runtime/cpu_packed.py), fitted CPU factors stay on
# their side of 64 rows (profile/query.py).
source benchmarks/gpu_session/setup.sh || exit 1
timeout 420 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=10 > $OUT/pytest_gpu.txt 2>&1; echo "suite rc $?"
tail -3 $OUT/pytest_gpu.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest_gpu.txt | cut -c1-250
