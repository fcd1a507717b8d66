# ~6.5 min (written 2026-12-06 in session 44; the next session's steps 1 and 2 in one call). The whole GPU suite
# on session 44's code, then the planned llama3-8b at 8 GiB against layers:17 twice (call_session44e.sh's RUN=b:
# fitted CPU factors kept in their row class), one engine_bench process each.
source benchmarks/gpu_session/setup.sh || exit 1
gpu_suite ${SUITE_SECONDS:-240}
for i in 1 2; do
  engine_step llama8_rowclass_b$i 150 --models llama3-8b --budgets 8 --batch-sizes 1,64 --repeat 1 --deadline-s 120 \
    --run-limit-s 8
  grep -E "took|VRAM budget \(" $OUT/llama8_rowclass_b$i.log | cut -c1-200 | head -6
done
