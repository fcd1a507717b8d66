# ~8.5 min (written 2026-12-06 in session 47). The GPU suite on session 47's code (session 46's quick-then-full
# re-plan after a fit, with a gpu-marked test of its own; the run-ahead worker's host experts as one bound C call),
# then qwen3-30b-a3b at 8 GiB, planned and experts-cpu with decode graphs, VRAMSHARD_RUN_AHEAD_ONE_CALL on, off,
# on (one process each: the one-call part against the Python job around the same kernel; compare decode_tok_s and
# decode_host_compute_ms less decode_worker_expert_kernel_ms). Each run also shows moe_bench's fix of session 46:
# every phase's before_gib near 0 and within_budget true.
# (--moe-only: the qwen3 runs alone, as call_session47b.sh runs them.)
source benchmarks/gpu_session/setup.sh || exit 1
[ "${1:-}" = --moe-only ] || gpu_suite ${SUITE_S:-230}
i=0
for one_call in ${ONE_CALL_RUNS:-on off on}; do
  i=$((i + 1))
  VRAMSHARD_RUN_AHEAD_ONE_CALL=$one_call timeout 85 python3 -m benchmarks.moe_bench --budgets 8 --batches 1 \
    --time-limit 65 --no-skewed --decode-steps 64 --placements planned,experts-cpu --profile "$PROFILE" \
    --decode-graphs --out $OUT/moe_one_call_${one_call}_$i.json > $OUT/moe_one_call_${one_call}_$i.log 2>&1
  echo "one call $one_call rc $? load $(cut -d' ' -f1-3 /proc/loadavg)"
  python3 - "$OUT/moe_one_call_${one_call}_$i.json" <<'PY'
import json, sys
for c in json.load(open(sys.argv[1]))["cells"]:
    print(" ", c["placement"], "tok/s", round(c.get("decode_tok_s", 0), 2), "step", round(c.get("decode_step_ms", 0), 1),
          "worker computing", round(c.get("decode_host_compute_ms", 0), 1), "kernel",
          round(c.get("decode_worker_expert_kernel_ms", 0), 1), "waiting", round(c.get("decode_host_wait_ms", 0), 1),
          "of bound", round(c.get("decode_fraction_of_bound", 0), 3), "within_budget", c.get("within_budget"),
          "before_gib", {k: round(v["before_gib"], 2) for k, v in c.get("peak_by_phase", {}).items()})
PY
done
