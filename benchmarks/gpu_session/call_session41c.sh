# ~5 min (written 2026-12-06 in session 41). Whether run-ahead should be on by default for MoE models: qwen3-30b-a3b
# at 8 GiB, planned and experts-cpu, with VRAMSHARD_RUN_AHEAD off (the default: the host thread computes the host
# experts between its launches) and on (the worker does, its team tuned), off/on/off/on in four processes. Every
# MoE figure since the twenty-third session ran with it on; the last A/B is the sixteenth session's (H200).
source benchmarks/gpu_session/setup.sh || exit 1
rm -f $OUT/commit.txt
moe_ahead_runs "off on off on" 48
