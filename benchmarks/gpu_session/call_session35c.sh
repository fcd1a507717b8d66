# ~7 min (written 2026-12-05 in session 34). nemo-8b at 8 and 2 GiB, each test three times, every step logged (the
# Planner issue's 12.4 and 7.6 tok/s; fp16 tiers may still pack where the profile finds it faster), then the
# planning process's effect on this 16-core host's CPU decode steps (benchmarks/plan_beside_steps.py).
source benchmarks/gpu_session/setup.sh || exit 1
engine_step nemo 330 --models nemo-8b --budgets 8,2 --batch-sizes 1 --repeat 3 --deadline-s 260 --run-limit-s 8 --log-steps
grep -E "step: .*, [0-9]{4,}\.[0-9] ms:|packed [0-9]+ split" $OUT/nemo.log | cut -c1-200 | head -12
timeout 150 python3 -m benchmarks.plan_beside_steps --profile "${PROFILE:-docs/profiles/h200-run33.json}" --threads 8 \
  --out $OUT/plan_beside_steps.json > $OUT/plan_beside_steps.log 2>&1; echo "plan_beside_steps rc $?"
grep -E "planning|no planning" $OUT/plan_beside_steps.log | tail -3 | cut -c1-220
