# ~6 min (written 2026-12-06 in session 49). The planned llama3-8b against layers:max with both engines loaded at
# once and stepped in turns (benchmarks/paired_decode.py): 8 ABBA rounds of 16 decode steps each at 1K context,
# at 2, 4 and 8 GiB. On hosts whose speed moved 1.36-1.56x between adjacent cells (forty-fourth GPU session), each
# round's ratio compares the engines seconds apart. Check "planned_switches_in_rounds" is empty.
source benchmarks/gpu_session/setup.sh || exit 1
timeout ${STEP_S:-540} python3 -m benchmarks.paired_decode --model llama3-8b --budgets ${BUDGETS:-2,4,8} \
  --rounds ${ROUNDS:-8} --steps 16 --profile "${PROFILE:-docs/profiles/h200-run26b.json}" \
  --json $OUT/paired.json > $OUT/paired.log 2>&1
echo "paired rc $?"
python3 - <<'PY'
import json, os
data = json.load(open(os.path.join(os.environ["OUT"], "paired.json")))
for budget, entry in data["budgets"].items():
    s = entry["summary"]
    print(budget, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in s.items()},
          "switches", entry["planned_switches_in_rounds"])
    print("   speedups", [round(r["speedup"], 2) for r in entry["rounds"]],
          "reads", [round(r["host_read_gb_s"]) for r in entry["rounds"]])
PY
python3 benchmarks/gpu_session/switches_after_warmup.py $OUT/paired.log | cut -c1-220
