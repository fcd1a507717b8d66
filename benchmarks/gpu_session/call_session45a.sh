# ~9 min (written 2026-12-06 in session 45, after 630 s of the session's device budget went to refused starts):
# one of each of the next session's checks in one call. The whole GPU suite on session 45's code; the planned
# llama3-8b at 8 GiB against layers:17 once (call_session44g.sh's run: fitted CPU factors kept in their row
# class); qwen3-30b-a3b at 8 GiB with the resident attention layers' CUDA graphs and without (call_session44f.sh's
# pair, once).
source benchmarks/gpu_session/setup.sh || exit 1
gpu_suite ${SUITE_SECONDS:-230}
engine_step llama8_rowclass_b1 150 --models llama3-8b --budgets 8 --batch-sizes 1,64 --repeat 1 --deadline-s 120 \
  --run-limit-s 8
grep -E "took|VRAM budget \(" $OUT/llama8_rowclass_b1.log | cut -c1-200 | head -6
GRAPHS="on off" bash benchmarks/gpu_session/call_session44f.sh
