# ~9.5 min (written 2026-12-05 in session 29, the first call of a machine lent late in the session): the
# whole GPU suite (sessions 28's and 29's GPU code: the worker's team, the host experts pass, the down
# copies, Qwen2-MoE and OLMoE, the executor's moved split steps, the prefix cache), then the prefix cache
# on llama3-8b at 8 GiB (a chat of 3 turns from a 2048-token prompt).
source benchmarks/gpu_session/setup.sh || exit 1
timeout 400 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=10 > $OUT/pytest_gpu.txt 2>&1; tail -3 $OUT/pytest_gpu.txt
grep -E "^(FAILED|ERROR)" $OUT/pytest_gpu.txt | cut -c1-300
timeout 130 python3 -m benchmarks.prefix_cache --shape llama3-8b --vram 8 --turns 3 --system 2048 --message 128 \
  --answer 16 --ctx 4096 --profile docs/profiles/h200-run26b.json --json $OUT/prefix_cache_8gib.json > $OUT/prefix_cache_8gib.log 2>&1
echo "prefix cache rc $?"; grep -E "^turn|different|Error" $OUT/prefix_cache_8gib.log | cut -c1-200
