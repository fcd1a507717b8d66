# ~8 min on a fresh machine: the GPU tests (the eighteenth session's planner variant without
# streaming slots has not run on a GPU), then benchmarks/gpu_session/call5.sh: the CPU's reads of
# pinned against pageable weights, and the report's nemo-8b 16 GiB / 4K cell with that planner
# (41.4 ms per step in the eighteenth, layers:40 18.3 ms).
source benchmarks/gpu_session/setup.sh || exit 1
timeout 300 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=10 > $OUT/pytest_gpu.txt 2>&1; tail -3 $OUT/pytest_gpu.txt
grep -E "^(FAILED|ERROR)" $OUT/pytest_gpu.txt | cut -c1-250
bash benchmarks/gpu_session/call5.sh
