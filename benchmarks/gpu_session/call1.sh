# ~9 min on a fresh machine: GPU tests (the changed graph-pool test among them), then the llama3-8b
# engine grid at 8 and 2 GiB planned from the fifteenth session's profile, without prepacked CPU
# weights, so split FFN parts take the compiled one-token projections over their column slices.
# Check: the planned decode against layers:17 at 8 GiB (9.73 against 10.10 in the fifteenth), no
# "the graph memory limit is reached" at 1K context, and no calibration at the limit of its factors.
source benchmarks/gpu_session/setup.sh || exit 1
timeout 220 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=5 > $OUT/pytest_gpu.txt 2>&1; tail -3 $OUT/pytest_gpu.txt
grep -E "^(FAILED|ERROR)" $OUT/pytest_gpu.txt | cut -c1-250
source benchmarks/gpu_session/engine_grid.sh; engine_grid llama3-8b 8,2 300 330
