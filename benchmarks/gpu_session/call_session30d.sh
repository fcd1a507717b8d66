# ~3.5 min (written 2026-12-05 in session 30, with 11 minutes of device time left; ran in the twenty-seventh
# GPU session). The GPU tests of the exact-size pinned host buffers (and of what reads
# them: the zero-copy experts, the prefix cache, split FFNs), then benchmarks.pinned_host.
source benchmarks/gpu_session/setup.sh || exit 1
timeout 170 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/test_pinned_host.py tests/test_prefix_cache.py \
  tests/test_zero_copy_experts.py tests/test_split_ffn.py "tests/test_moe.py::test_gpu_moe_host_experts_read_by_the_gpu_from_pinned_memory_match_cpu" > $OUT/pytest_gpu.txt 2>&1; echo "gpu tests rc $?"; tail -4 $OUT/pytest_gpu.txt
timeout 60 python3 -m benchmarks.pinned_host --json $OUT/pinned_host.json > $OUT/pinned_host.log 2>&1; echo "pinned rc $?"
grep -E "MB:|Error" $OUT/pinned_host.log
