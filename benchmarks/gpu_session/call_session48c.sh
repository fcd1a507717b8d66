# ~9 min (written 2026-12-06 in session 48). Whether the planned engine beats layers:N at every budget, on a host
# whose read moves 1.6x within minutes (forty-third GPU session): llama3-8b at 2, 4 and 8 GiB, each budget's
# planned engine and layers:max in the order planned, baseline, baseline, planned (engine_bench --abba: the checks
# are the two rounds' geometric means), the host's read around every cell. Compare each round's speedup with the
# read ratio beside it (`*_host_read_vramshard_over_layers_max`).
source benchmarks/gpu_session/setup.sh || exit 1
engine_step abba ${STEP_S:-575} --models llama3-8b --budgets ${BUDGETS:-2,4,8} --batch-sizes 1 --repeat 1 \
  --deadline-s ${DEADLINE_S:-520} --run-limit-s 12 --abba
python3 - <<'PY'
import json, os
checks = json.load(open(os.path.join(os.environ["OUT"], "abba.json")))["models"]["llama3-8b"]["checks"]
for i, r in enumerate(checks.get("rounds", []), 1):
    print("round", i, {k: round(v, 3) for k, v in r.items() if "tg_speedup" in k or "host_read_vramshard" in k})
print("geometric means", {k: round(v, 3) for k, v in checks.items() if "tg_speedup" in k or "batch1_speedup" in k})
PY
