# ~7.5 min (written 2026-12-06 in session 50). The whole GPU suite on session 50's code (a switch asks the buffers
# it dropped whether something still holds them before collecting garbage: tests/test_executor_gpu.py's
# test_a_switch_collects_garbage_only_where_a_dropped_buffer_is_still_held, with two engines loaded), then
# llama3-8b at 8 GiB with batch 64 against layers:max, the batched step's bound beside it (the Engine issue's 3x;
# the forty-fifth session's call for it was refused).
source benchmarks/gpu_session/setup.sh || exit 1
gpu_suite ${SUITE_SECONDS:-240}
engine_step b64 ${B64_S:-230} --models llama3-8b --budgets 8 --batch-sizes 64 --repeat 1 --deadline-s 200 \
  --run-limit-s 10
python3 - <<'PY'
import json, os
checks = json.load(open(os.path.join(os.environ["OUT"], "b64.json")))["models"]["llama3-8b"]["checks"]
print({k: round(v, 3) for k, v in checks.items() if isinstance(v, float) and "64" in k})
PY
