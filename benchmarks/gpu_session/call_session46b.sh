# ~5 min (written 2026-12-06 in session 46). One qwen3-30b-a3b run with decode graphs (moe_bench's batch phase
# used to start with the decode phase's resident weights still held, "before_gib" 2.4-2.9 GiB: it should now be
# near 0 and within_budget true), then llama3-8b at 2 GiB against layers:max, TTFT for a 1K prompt twice per
# engine (the Engine issue's TTFT within 1.1x of its bound at 2 GiB).
source benchmarks/gpu_session/setup.sh || exit 1
GRAPHS=on bash benchmarks/gpu_session/call_session44f.sh | tail -3
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/moe_graphs_on_1.json"))
for c in d["cells"]:
    print(c["placement"], "within_budget", c.get("within_budget"), "peak", round(c.get("peak_vram_gib", 0), 2),
          {k: round(v["before_gib"], 2) for k, v in c.get("peak_by_phase", {}).items()})
PY
engine_step llama2 ${LLAMA2_S:-150} --models llama3-8b --budgets 2 --batch-sizes 1 --repeat 2 --deadline-s 130 --run-limit-s 8
