# ~7 min (written 2026-12-06 in session 49). The planned llama3-8b against layers:max with both engines loaded at
# once and stepped in turns (benchmarks/paired_decode.py): at 2, 4 and 8 GiB, 6 ABBA rounds of 16 decode steps
# each at 1K context, then 6 at a short chat's (a 16-token prompt: in the forty-third session the planned engine's
# batch-1 steps at short context ran 1.00-1.35x its 1K steps at 2 GiB). On hosts whose speed moved 1.36-1.56x
# between adjacent cells (forty-fourth GPU session), each round's ratio compares the engines seconds apart.
# Check that "planned_switches_in_rounds" is empty.
source benchmarks/gpu_session/setup.sh || exit 1
timeout ${STEP_S:-560} python3 -m benchmarks.paired_decode --model llama3-8b --budgets ${BUDGETS:-2,4,8} \
  --pps ${PPS:-1024,16} --rounds ${ROUNDS:-6} --steps 16 --profile "${PROFILE:-docs/profiles/h200-run26b.json}" \
  --json $OUT/paired.json > $OUT/paired.log 2>&1
echo "paired rc $?"
python3 - <<'PY'
import json, os
data = json.load(open(os.path.join(os.environ["OUT"], "paired.json")))
for budget, entry in data["budgets"].items():
    for pp, run in entry.get("prompts", {}).items():
        s = run["summary"]
        print(budget, "pp", pp, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in s.items()
                                 if k != "planned_plans"}, "switches", run["planned_switches_in_rounds"])
        print("   speedups", [round(r["speedup"], 2) for r in run["rounds"]],
              "reads", [round(r["host_read_gb_s"]) for r in run["rounds"]])
PY
grep -E "warm-up (done|ended|round)" $OUT/paired.log | cut -c1-200
