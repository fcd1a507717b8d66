# ~7 min (written 2026-12-06 in session 48). Whether packing a re-plan's CPU parts ahead (VRAMSHARD_PACK_AHEAD,
# new in session 48, on by default) shortens the steps' stop at the switch: llama3-8b at 2 and 8 GiB, one
# engine_bench process with it off, then one with it on. Compare each planned cell's slowest decode step (the
# summary's first stall figure) and, in the logs, each "reconfigured to ... in N ms (...; CPU parts A ms, CPU
# kernels B ms; ...)" line: off, the packing is within "CPU parts".
source benchmarks/gpu_session/setup.sh || exit 1
switch_runs VRAMSHARD_PACK_AHEAD "${PACK_AHEAD_RUNS:-off on}" pack_ahead ${STEP_S:-270} --models llama3-8b \
  --budgets 2,8 --batch-sizes 1 --repeat 1 --deadline-s 255 --run-limit-s 15
for log in $OUT/pack_ahead_*.log; do
  echo "$log"; grep -oE "in [0-9.]+ ms \(VRAM released after [0-9.]+ ms; [^;]*;" "$log" | cut -c1-160
done
