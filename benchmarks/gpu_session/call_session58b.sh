# ~9 min (written 2026-12-07 in session 58). Every gpu-marked test as the defaults run them now (the link codec on
# since a640b6e; SUITE_S, default 330), then llama3-8b at 8 GiB batch 64 planned against layers:17 paired in ABBA
# rounds (benchmarks/paired_decode --batch 64; PAIRED_S, default 230), VRAMSHARD_VRAM_CODEC=$VRAM (default off).
source benchmarks/gpu_session/setup.sh || exit 1
[ "${SUITE_S:-330}" != 0 ] && gpu_suite ${SUITE_S:-330}
VRAMSHARD_VRAM_CODEC=${VRAM:-off} timeout ${PAIRED_S:-230} python3 -m benchmarks.paired_decode --model llama3-8b \
  --budgets 8 --pps 16 --batch 64 --rounds ${ROUNDS:-3} --steps 4 --profile "$PROFILE" --json $OUT/paired_b64.json \
  > $OUT/paired_b64.log 2>&1
echo "paired rc $?"; grep -E "vramshard [0-9]|round|Error|error" $OUT/paired_b64.log | tail -12 | cut -c1-400
