# ~9 min (written 2026-12-07 in session 60; `timeout_s` 590). Where a planned batch-64 step at 8 GiB goes: llama3-8b
# planned:8 at tier 64 (`step_profile --seqs 64`, fill graphs and link codec on, cProfile of the host) and at tier 1,
# then engine_bench batch 64 against layers:17 in ABBA order, each cell now with the cores other processes kept busy over it
# and the steal among them (engine_summary's "beside O/S"). The fifty-fifth session ran batch 64 at 2.88x layers:17 in
# engine_bench (paired 2.10x and 2.40x) against 3x asked; its planned steps took 108-153 ms, the batched bound 80.
# With call_session61a.sh's profile of this boot on the machine (bench_out/profile-run61a.json) both price from it:
# the step's price then needs no scaling from another host's profile (PROFILE= overrides).
[ -z "${PROFILE:-}" ] && [ -f bench_out/profile-run61a.json ] && export PROFILE=bench_out/profile-run61a.json
source benchmarks/gpu_session/setup.sh || exit 1
VRAMSHARD_WIRE_CODEC=on timeout ${STEPS_S:-150} python3 -m benchmarks.step_profile --shape llama3-8b --seqs 64 \
  --placements planned:8+graphs --profile "$PROFILE" --pystats 40 --json $OUT/steps64.json > $OUT/steps64.log 2>&1
echo "step_profile rc $?"; step_summary $OUT/steps64.json
# The same at one row: the split parts' rate (split_part_gbps) against the one-row price of this boot's profile.
VRAMSHARD_WIRE_CODEC=on timeout ${STEPS1_S:-90} python3 -m benchmarks.step_profile --shape llama3-8b \
  --placements planned:8+graphs --profile "$PROFILE" --json $OUT/steps1.json > $OUT/steps1.log 2>&1
echo "step_profile (1 row) rc $?"; step_summary $OUT/steps1.json
engine_step b64_abba ${ENGINE_S:-300} --models llama3-8b --budgets 8 --batch-sizes 64 --repeat 1 --abba \
  --deadline-s $(( ${ENGINE_S:-300} - 60 )) --run-limit-s 10
grep -E "fitted|took" $OUT/b64_abba.log | cut -c1-260 | tail -4
