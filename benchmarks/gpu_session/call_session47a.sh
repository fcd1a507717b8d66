# ~8.5 min (written 2026-12-06 in session 47). The GPU suite on session 46's code (its quick-then-full re-plan
# after a fit, with a gpu-marked test of its own), then call_session46b.sh: moe_bench with decode graphs after its
# fix (each phase's before_gib near 0, within_budget true) and llama3-8b's TTFT at 2 GiB, two runs per engine.
source benchmarks/gpu_session/setup.sh || exit 1
gpu_suite ${SUITE_S:-230}
bash benchmarks/gpu_session/call_session46b.sh
