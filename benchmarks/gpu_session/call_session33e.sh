# ~8 min (written 2026-12-05 in session 33). Prompt chunks' CPU parts packed by a background thread
# (runtime/cpu_packed.py): the GPU tests of split FFNs, the engine and the budget, then llama3-8b at 8 and
# 2 GiB, batch 1 and 64 (in the thirty-third session's first calls a 1K prompt after a re-plan took 2.31 s
# to its first token at 8 GiB, most of it packing in the step). PROFILE= as call_session33c.sh.
source benchmarks/gpu_session/setup.sh || exit 1
timeout 170 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/test_executor_gpu.py tests/test_engine_batching.py \
  tests/test_budget.py tests/test_cpu_packed.py > $OUT/pytest_gpu.txt 2>&1; echo "tests rc $?"
tail -2 $OUT/pytest_gpu.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest_gpu.txt | cut -c1-250
engine_step llama_bg 250 --models llama3-8b --budgets 8,2 --batch-sizes 1,64 --deadline-s 200 --run-limit-s 10
grep -E "packed|CPU work of plan|decode steps of|going back" $OUT/llama_bg.log | cut -c1-230 | head -20
