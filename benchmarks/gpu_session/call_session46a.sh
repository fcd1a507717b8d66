# ~7 min (written 2026-12-06 in session 46). A full profile of this machine against the stored one of its kind
# ($PROFILE: benchmarks/profile_check.py --against, the Profiler issue's repeatability across two full profiles),
# then one qwen3-30b-a3b run with decode graphs (moe_bench's batch phase used to start with the last phase's
# resident weights still held: "before_gib" 2.4-2.9 GiB; it should now be near 0 and within_budget true).
source benchmarks/gpu_session/setup.sh || exit 1
timeout ${PROFILE_S:-330} python3 benchmarks/profile_check.py --against "$PROFILE" --out $OUT/profile_check.json \
  > $OUT/profile_check.log 2>&1
echo "profile_check rc $?"; cp profile_run*.json $OUT/ 2>/dev/null
tail -40 $OUT/profile_check.log
GRAPHS=on bash benchmarks/gpu_session/call_session44f.sh | tail -3
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/moe_graphs_on_1.json"))
for c in d["cells"]:
    print(c["placement"], "within_budget", c.get("within_budget"), {k: round(v["before_gib"], 2) for k, v in c.get("peak_by_phase", {}).items()})
PY
