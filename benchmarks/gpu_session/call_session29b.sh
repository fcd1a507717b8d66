# ~5 min (written 2026-12-05 in session 29): the prefix cache (new in session 29, CPU-tested only) on
# the GPU machine: a chat of 3 turns on llama3-8b at 2 and 8 GiB, a 2048-token first prompt and 128
# new tokens a turn, time to first token with the conversation's scheduler kept (its prefix cache) and
# with a fresh scheduler each turn. Both ways must give the same tokens (same_tokens in the JSON).
source benchmarks/gpu_session/setup.sh || exit 1
PROFILE=${PROFILE:-docs/profiles/h200-run26b.json}
for GIB in 2 8; do
  timeout 140 python3 -m benchmarks.prefix_cache --shape llama3-8b --vram $GIB --turns 3 --system 2048 --message 128 \
    --answer 16 --ctx 4096 --profile $PROFILE --json $OUT/prefix_cache_${GIB}gib.json > $OUT/prefix_cache_${GIB}gib.log 2>&1
  echo "prefix cache ${GIB} GiB rc $?"; grep -E "^turn|different" $OUT/prefix_cache_${GIB}gib.log
done
