# ~6 min (written 2026-12-05 in session 32). The run-ahead worker with the C decode kernel: its ctypes
# calls leave the GIL free for their whole run (oneDNN's and inductor's leave it only around the kernel),
# so the split parts on the worker may now overlap the host thread's launches. nemo-8b at 8 and 2 GiB,
# VRAMSHARD_RUN_AHEAD=on (10.83 against 10.95 tok/s off at 8 GiB in the twenty-eighth session, before the
# kernel); compare with call_session33c.sh's figures on the same boot.
source benchmarks/gpu_session/setup.sh || exit 1
VRAMSHARD_RUN_AHEAD=on engine_step nemo_ahead 300 --models nemo-8b --budgets 8,2 --batch-sizes 1 --deadline-s 230 \
  --run-limit-s 10
