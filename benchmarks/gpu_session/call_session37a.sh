# ~4 min (written 2026-12-05 in session 37). The GPU tests that failed in session 37's suite run (their
# expectations predated packing only where the plan packs), then a split FFN part of llama3-8b at 16 and 64 rows
# on this host's 16 threads, projections and compiled (the engine's 16- and 64-token steps took 0.9-1.3 s of
# split parts at 8 GiB against ~0.04 s for a one-token step), then llama3-8b at 8 GiB batch 1 with the planning
# process at the idle scheduling class (its calibration plan had slowed decode steps 2-5x), every step logged.
source benchmarks/gpu_session/setup.sh || exit 1
timeout 90 python3 -m pytest -q -rs -p no:cacheprovider tests/test_plan_process.py \
  "tests/test_executor_gpu.py::test_split_ffn_placement_matches_cpu_float32" \
  "tests/test_executor_gpu.py::test_split_ffn_one_row_parts_by_the_c_kernel_match_cpu_float32" \
  > $OUT/pytest_fixed.txt 2>&1; echo "tests rc $?"; tail -2 $OUT/pytest_fixed.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest_fixed.txt
timeout 70 python3 -m benchmarks.cpu_swiglu --rows 16,64 --repeats 5 --parts "llama3-8b quarter" \
  --json $OUT/cpu_swiglu.json > $OUT/cpu_swiglu.log 2>&1; echo "cpu_swiglu rc $?"; grep "{'part'" $OUT/cpu_swiglu.log | cut -c25-
PROFILE=docs/profiles/h100-run34.json engine_step llama8 150 --models llama3-8b --budgets 8 --batch-sizes 1 --repeat 1 \
  --deadline-s 120 --run-limit-s 8 --log-steps
grep -E "planning process|reconfigured|step: 1 token.*, [0-9]{3,}\.[0-9] ms:|step: (16|64) token" $OUT/llama8.log | cut -c1-170 | head -24
