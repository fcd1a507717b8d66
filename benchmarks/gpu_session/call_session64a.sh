# ~9 min (written 2026-12-08 in session 64; `timeout_s` 590). The Planner issue's table, which no GPU session has
# run since the seventh: benchmarks.planner_bench (every family of each tier measured beside its price, the
# chosen plan's error, whether it was the fastest, tier 1 against the best layers:N and the decode bound) for
# MODEL (default llama3-8b) at BUDGETS (default 2,4,8), tiers 1,16,64,512, planned from the host's own quick
# profile (kept as bench_out/profile-quick64a.json while the machine is warm; PROFILE names another). Families
# priced over WITHIN (default 2) times the winner are not run (said so in the JSON).
ASKED_PROFILE=${PROFILE:-}
[ -z "$ASKED_PROFILE" ] && [ -f bench_out/profile-quick63c.json ] && ASKED_PROFILE=bench_out/profile-quick63c.json
source benchmarks/gpu_session/setup.sh || exit 1
W=/tmp/call64a; mkdir -p $W bench_out
keep() { cp $OUT/commit.txt $OUT/machine.txt $W/ 2>/dev/null; tar -C $W -czf $OUT/call.tgz . ; }
host_profile profile-quick64a $W
keep
MODEL=${MODEL:-llama3-8b}; LIMIT=${BENCH_S:-480}
timeout $LIMIT python3 -m benchmarks.planner_bench --models $MODEL --budgets ${BUDGETS:-2,4,8} --tiers 1,16,64,512 \
  --measure-within ${WITHIN:-2} --profile "$PROFILE" --deadline-s $(( LIMIT - 60 )) \
  --out $W/planner_bench_$MODEL.json > $W/planner_bench_$MODEL.log 2>&1
echo "planner_bench rc $?"
python3 - $W/planner_bench_$MODEL.json <<'PY'
import json, sys
data = json.load(open(sys.argv[1]))
for name, entry in data["models"].items():
    for c in entry["cells"]:
        print(name, c["budget_gib"], c["tier"], c["chosen"], "err", round(c.get("error_pct", float("nan")), 1),
              "fastest", c.get("chosen_is_fastest"), {k: round(v, 1) for k, v in c["measured_ms"].items()},
              "of bound", round(c.get("of_bound", 0), 3), c.get("baseline"), round(c.get("baseline_tok_s", 0), 2))
    print("skipped", entry["skipped"])
PY
keep; ls -la $OUT
