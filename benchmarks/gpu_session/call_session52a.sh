# ~9.5 min (written 2026-12-07 in session 52). The whole GPU suite on session 51's code (its revert keeps other
# tiers' CPU fits; never run whole on a GPU), the collect test with the dropped buffers not asked (it must fail),
# the planner's tier-64 placements of llama3-8b at 8 GiB family by family, then one batch-64 run at 8 GiB against
# layers:max (call_session51a.sh's steps without its part of the suite).
source benchmarks/gpu_session/setup.sh || exit 1
gpu_suite ${SUITE_S:-250}
SKIP_PART=1 RUNS=${RUNS:-a} B64_S=${B64_S:-140} bash benchmarks/gpu_session/call_session51a.sh
