# ~6.5 min (written 2026-12-07 in session 52, when refused starts had left too little for call_session52a.sh): the
# whole GPU suite on session 51's code, then one batch-64 run of llama3-8b at 8 GiB against layers:max (where a
# "going back to it" line appears, the revert should say which tiers' fits it kept).
source benchmarks/gpu_session/setup.sh || exit 1
gpu_suite ${SUITE_S:-230}
engine_step b64a ${B64_S:-135} --models llama3-8b --budgets 8 --batch-sizes 64 --repeat 1 --deadline-s 125 \
  --run-limit-s 10
grep -E "going back|tiers .* as re-planned|re-planned tier" $OUT/b64a.log | cut -c1-300
