# ~1.5 min a run (run 2026-12-06 in session 44 as its calls 7, 8 and 9, on tree 1079b7d: fitted CPU factors kept in
# their row class). llama3-8b at 8 GiB, planned against layers:max (layers:17), one engine_bench process:
#   call 7: RUN=a (batch 1 only, a 70-s deadline); calls 8 and 9: RUN=b and RUN=c (batch 1 and 64).
# Compare the planned decode with layers:17's in the same run, and which tier each fit was made at.
source benchmarks/gpu_session/setup.sh || exit 1
case "${RUN:-b}" in
  a) engine_step llama8_rowclass 85 --models llama3-8b --budgets 8 --batch-sizes 1 --repeat 1 --deadline-s 70 \
       --run-limit-s 6 ;;
  b) engine_step llama8_rowclass_b 150 --models llama3-8b --budgets 8 --batch-sizes 1,64 --repeat 1 --deadline-s 120 \
       --run-limit-s 8 ;;
  c) engine_step llama8_rowclass_c 130 --models llama3-8b --budgets 8 --batch-sizes 1,64 --repeat 1 --deadline-s 110 \
       --run-limit-s 8 ;;
esac
grep -E "took|fitted|VRAM budget \(" $OUT/llama8_rowclass*.log | cut -c1-240 | head
