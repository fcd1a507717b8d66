# ~8.5 min on a fresh machine: GPU tests; the GIL handover on this host; run-ahead and prepacked
# weights in llama3-8b steps at 64 rows; MoE experts read by the GPU from host memory, in the
# step and alone against the copy engine.
source benchmarks/gpu_session/setup.sh || exit 1
timeout 190 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=15 > $OUT/pytest_gpu.txt 2>&1; tail -3 $OUT/pytest_gpu.txt
grep -E "^(FAILED|ERROR)" $OUT/pytest_gpu.txt | cut -c1-250
timeout 35 python3 -m benchmarks.gil_handoff --json $OUT/gil_handoff.json > $OUT/gil_handoff.log 2>&1; grep "'rows'" $OUT/gil_handoff.log | cut -c25-520
OMP_WAIT_POLICY=PASSIVE timeout 35 python3 -m benchmarks.gil_handoff --json $OUT/gil_handoff_passive.json > $OUT/gil_handoff_passive.log 2>&1
grep "'rows'" $OUT/gil_handoff_passive.log | cut -c25-520
timeout 100 python3 -m benchmarks.step_profile --shape llama3-8b --seqs 64 --ctx 32 --steps 4 --rows 8 \
  --placements planned:8+graphs+packed,planned:8+graphs+ahead+packed,planned:8+graphs+ahead \
  --profile docs/profiles/h200-queued.json --json $OUT/steps_ahead_64.json > $OUT/steps_ahead_64.log 2>&1; echo "rc $?"
grep -E "'placement'|not available|failed|Error" $OUT/steps_ahead_64.log | cut -c25-330
timeout 45 python3 -m benchmarks.zero_copy --experts --json $OUT/zero_copy_experts.json > $OUT/zero_copy_experts.log 2>&1; echo "rc $?"
grep -E "'tokens'|Error" $OUT/zero_copy_experts.log | cut -c25-330
timeout 120 python3 -m benchmarks.step_profile --shape qwen3-30b-a3b --layers 8 --steps 4 \
  --placements experts-cpu,experts-cpu+zerocopy,experts-stream,experts-stream+zerocopy,experts-cpu+ahead --expert-cache-gib 1 \
  --profile docs/profiles/h200-queued.json --json $OUT/moe_steps.json > $OUT/moe_steps.log 2>&1; echo "rc $?"
grep -E "'placement'|failed|Error" $OUT/moe_steps.log | cut -c25-330
