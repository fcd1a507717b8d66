# ~8 min (written 2026-12-05 in session 34). llama3-8b at 8 and 2 GiB, batch 1 and 64, each test three times, every
# step logged: with plans made in the planning process, no step should stall beside a re-plan (the thirty-first
# session's 1.1-3.6 s steps, a 4.31 s TTFT at 2 GiB), and bf16 tiers whose profile times packed FFNs no faster
# pack nothing (no 2.2-3.6 s packing steps). PROFILE=: this machine's full profile (docs/profiles/h100-run34.json
# on an H100, docs/profiles/h200-run33.json on an H200).
source benchmarks/gpu_session/setup.sh || exit 1
engine_step llama 520 --models llama3-8b --budgets 8,2 --batch-sizes 1,64 --repeat 3 --deadline-s 430 --run-limit-s 8 --log-steps
grep -E "planning process|step: .*, [0-9]{4,}\.[0-9] ms:|packed [0-9]+ split|loaded model" $OUT/llama.log | cut -c1-200 | head -30
