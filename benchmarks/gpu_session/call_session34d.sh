# ~5 min (written 2026-12-05 in session 34). Why llama3-8b's 2 GiB TTFT read 4.31 s against a 0.33 s bound in
# call_session34b.sh (H100, its own profile docs/profiles/h100-run34.json): the same engines, each TTFT run
# three times, every step's times and each row-major down copy logged.
source benchmarks/gpu_session/setup.sh || exit 1
engine_step probe 300 --models llama3-8b --budgets 8,2 --batch-sizes 1 --repeat 3 --deadline-s 240 --run-limit-s 6 --log-steps
grep -E "step: [0-9]{3,} token|copied|packed|reconfigured|CPU work of plan" $OUT/probe.log | cut -c1-260 | head -70
