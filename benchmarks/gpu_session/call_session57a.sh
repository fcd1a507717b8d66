# ~4 + 2 a run min (written 2026-12-07 in session 57). Are both codecs ready to be the default? Every gpu-marked
# test with VRAMSHARD_WIRE_CODEC=on and VRAMSHARD_VRAM_CODEC=on (the tests that count streamed bytes or VRAM have
# only run with them off; SUITE_S=0 skips them), then llama3-8b at BUDGETS GiB (default 8) batch 64 against
# layers:max with both codecs on and both off (CODEC_PAIRS, default "on off on off"), one process each.
source benchmarks/gpu_session/setup.sh || exit 1
export VRAMSHARD_WIRE_CODEC=on VRAMSHARD_VRAM_CODEC=on
[ "${SUITE_S:-240}" = 0 ] || gpu_suite ${SUITE_S:-240}
for codec in ${CODEC_PAIRS:-on off on off}; do
  i=$((${i:-0} + 1))
  ( export VRAMSHARD_WIRE_CODEC=$codec VRAMSHARD_VRAM_CODEC=$codec
    engine_step "codecs_${codec}_$i" ${RUN_S:-125} --models llama3-8b --budgets ${BUDGETS:-8} --batch-sizes 64 \
      --repeat 1 --deadline-s 115 --run-limit-s 10 )
done
grep -hE "coded in VRAM|pinned set" $OUT/codecs_*.log | cut -c1-250
