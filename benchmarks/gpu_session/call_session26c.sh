# ~1.5 min (written 2026-12-05, session 26): the MoE GPU tests. The planner now gives decode tiers a CPU
# share of the zero-copy experts (TieredPlacement.zero_copy_cpu_shares), which the executor takes from
# its plan; a plan's share must run on the worker and match the CPU reference.
source benchmarks/gpu_session/setup.sh || exit 1
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_moe.py > $OUT/pytest_gpu_moe.txt 2>&1
tail -2 $OUT/pytest_gpu_moe.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest_gpu_moe.txt | cut -c1-250
