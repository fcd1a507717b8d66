# ~9.5 min (written 2026-12-05 in session 32). With PROFILE= the profile of call_session33b.sh (timed
# through the C decode kernel): nemo-8b at 8 and 2 GiB against layers:max (the Planner issue's 12.4 and
# 7.6 tok/s), then llama3-8b at 8 GiB batch 1 and 64 (the Engine issue's 3x).
source benchmarks/gpu_session/setup.sh || exit 1
engine_step nemo_decode 260 --models nemo-8b --budgets 8,2 --batch-sizes 1 --deadline-s 200 --run-limit-s 10
engine_step llama_b64 280 --models llama3-8b --budgets 8 --batch-sizes 1,64 --deadline-s 220 --run-limit-s 12
