# ~8 min (written 2026-12-05 in session 33). llama3-8b at 8 and 2 GiB, batch 1 and 64 (the Engine issue's 3x and
# TTFT within 1.1x of its bound at 2 GiB; the thirtieth session's TTFTs were 1.4-2.3 s against 0.2 s bounds, its
# 1024-row tier split on a factor fitted at 64 rows), then nemo-8b at 8 and 2 GiB (the Planner issue's 12.4 and
# 7.6 tok/s). PROFILE=: this machine's full profile (docs/profiles/h200-run33.json on an H200; on an H100 run
# call_session33b.sh first and keep its profile as docs/profiles/h100-run34.json).
source benchmarks/gpu_session/setup.sh || exit 1
engine_step llama 280 --models llama3-8b --budgets 8,2 --batch-sizes 1,64 --deadline-s 220 --run-limit-s 10
grep -E "CPU work of plan|decode steps of|going back|beyond the factors" $OUT/llama.log | cut -c1-230 | head -12
engine_step nemo 250 --models nemo-8b --budgets 8,2 --batch-sizes 1 --deadline-s 190 --run-limit-s 10
