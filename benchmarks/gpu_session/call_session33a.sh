# ~7 min on a fresh machine (written 2026-12-05 in session 32). The whole GPU suite with the C decode
# kernel the default beside a GPU (layers/cpu_gemv.c; VRAMSHARD_CPU_GEMV=auto), not yet run whole with it.
source benchmarks/gpu_session/setup.sh || exit 1
timeout 420 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=10 > $OUT/pytest_gpu.txt 2>&1; echo "suite rc $?"
tail -3 $OUT/pytest_gpu.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest_gpu.txt | cut -c1-250
