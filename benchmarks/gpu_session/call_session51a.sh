# ~7 min (written 2026-12-07 in session 51). The GPU tests of the executor, the budget follower and the
# calibration (session 51 fixed the collect test's premise: a tiny engine's buffers are under the allocator's
# slack, so its switch never looked at the process's VRAM; and a revert now keeps other tiers' CPU fits), the
# collect test once more with the dropped buffers not asked (it must fail), the planner's tier-64 placements of
# llama3-8b at 8 GiB family by family (benchmarks/step_profile.py), then llama3-8b at 8 GiB with batch 64
# against layers:max twice (a revert at tier 1 threw tier 64's CPU fit away in the forty-sixth session's call 1).
# SKIP_PART=1: the three test files not run here (call_session52a.sh runs the whole suite first); SKIP_MUTANT=1:
# not the collect test's mutant (it failed as it should in the forty-sixth session's call 3).
source benchmarks/gpu_session/setup.sh || exit 1
if [ -z "$SKIP_PART" ]; then
  timeout 200 python3 -m pytest -m gpu -q -rfEs --tb=short -p no:cacheprovider tests/test_executor_gpu.py \
    tests/test_calibrate.py tests/test_budget.py > $OUT/pytest_gpu_part.txt 2>&1
  echo "part rc $?"; tail -2 $OUT/pytest_gpu_part.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest_gpu_part.txt | cut -c1-250
fi
if [ -z "$SKIP_MUTANT" ]; then
cp src/vramshard/runtime/executor.py /tmp/executor.py
python3 - <<'PY'
path = "src/vramshard/runtime/executor.py"
text = open(path).read()
assert "if real_gpu and dropped.held() and" in text
open(path, "w").write(text.replace("if real_gpu and dropped.held() and", "if real_gpu and"))
PY
timeout 90 python3 -m pytest -m gpu -q --tb=line -p no:cacheprovider tests/test_executor_gpu.py \
  -k collects_garbage_only > $OUT/pytest_gpu_mutant.txt 2>&1
echo "mutant rc $? (1: the test caught it)"; tail -2 $OUT/pytest_gpu_mutant.txt
cp /tmp/executor.py src/vramshard/runtime/executor.py
fi
# tier 64 alone (64 sequences at 32 keys): the planner's placement for each family over one pinned set, measured
timeout 150 python3 -m benchmarks.step_profile --shape llama3-8b --seqs 64 --ctx 32 --steps 10 --warmup 12 \
  --placements planned:8/search,planned:8/split,planned:8/dynamic,planned:8/static --rows 5 \
  --profile "$PROFILE" --json $OUT/tier64.json > $OUT/tier64.log 2>&1; echo "tier64 rc $?"
python3 - <<'PY'
import json, os
path = os.path.join(os.environ["OUT"], "tier64.json")
for r in json.load(open(path))["placements"] if os.path.exists(path) else []:
    print(r["placement"], r.get("error") or {k: round(r[k], 1) for k in ("wall_ms", "predicted_ms", "host_compute_ms",
                                                                         "host_wait_ms") if k in r})
PY
for run in ${RUNS:-a b}; do
  engine_step b64$run ${B64_S:-150} --models llama3-8b --budgets 8 --batch-sizes 64 --repeat 1 --deadline-s 130 \
    --run-limit-s 10
  grep -E "going back|tiers .* as re-planned" $OUT/b64$run.log | cut -c1-300
done
