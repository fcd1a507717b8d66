# ~5.5 min on a fresh machine (written 2026-12-05 in session 34). The whole GPU suite after session 34's changes:
# background plans in a child process (runtime/plan_process.py), packing only at the tiers a plan says
# (TieredPlacement.packed, from the profile's packed factors).
source benchmarks/gpu_session/setup.sh || exit 1
timeout 450 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=10 > $OUT/pytest_gpu.txt 2>&1; echo "suite rc $?"
tail -3 $OUT/pytest_gpu.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest_gpu.txt | cut -c1-250
