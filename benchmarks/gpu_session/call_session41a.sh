# ~3.5 min (written 2026-12-06 in session 41). The run-ahead worker's team tuning (runtime/team_tuner.py), new in
# session 41: its GPU test (each step's parts run with the tuner's team; tokens as the CPU reference's), then
# qwen3-30b-a3b at 8 GiB experts-cpu, run-ahead on, with the tuning on (the default) and off, alternating
# (SECONDS_EACH a run, default 60; 64 decode steps: the first trial of a smaller team comes after 12). In the
# thirty-sixth session's runs a team of 15 collapsed in 4 of 8 runs (kernel 149-244 ms a step against 55-89); with
# the tuning the log should say "taking 13" (or less) in such a run. TUNINGS="on off on off" for more runs.
source benchmarks/gpu_session/setup.sh || exit 1
rm -f $OUT/commit.txt
timeout 60 python3 -m pytest -q -p no:cacheprovider -rs tests/test_moe.py -k tuners_team > $OUT/pytest_tuner.txt 2>&1
echo "tuner test rc $?"; tail -2 $OUT/pytest_tuner.txt
FIELDS="'decode_tok_s': [0-9.]*|'decode_step_ms': [0-9.]*|'decode_worker_team': [0-9]*|'decode_worker_expert_kernel_ms': [0-9.]*"
i=0
for tuning in ${TUNINGS:-on off}; do
  i=$((i + 1))
  VRAMSHARD_WORKER_TEAM_TUNING=$tuning VRAMSHARD_RUN_AHEAD=on timeout $(( ${SECONDS_EACH:-60} + 20 )) \
    python3 -m benchmarks.moe_bench --budgets 8 --batches 1 --time-limit ${SECONDS_EACH:-60} --no-skewed --decode-steps 64 \
    --placements experts-cpu --profile "$PROFILE" --out $OUT/moe_tuning_${tuning}_$i.json > $OUT/moe_tuning_${tuning}_$i.log 2>&1
  echo "tuning $tuning rc $? load $(cut -d' ' -f1-3 /proc/loadavg)"; grep -oE "$FIELDS" $OUT/moe_tuning_${tuning}_$i.log | tr '\n' ' '
  echo; grep -E "run-ahead worker:" $OUT/moe_tuning_${tuning}_$i.log | cut -c1-220 | tail -4
done
