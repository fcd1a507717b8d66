# ~9.5 min (written 2026-12-06 in session 39; call_session38a.sh with its prefetch A/B, inconclusive twice, replaced).
# 1. The whole GPU suite (sessions 37-38 changed GPU code; session 38's profile table and drift floor not yet run).
# 2. llama3-8b at 8 GiB, batch 1 and 64, every step logged (the drift line should say x0.95 or nothing).
# 3. The routed experts' down rows shared evenly over the team (session 38) at 15 and 16 threads: needs the
#    untracked .kernel-before-shares.c (`git show 0b94414:src/vramshard/layers/cpu_gemv.c`), which travels along.
# 4. The experts kernel after a pause like the GPU's part of a layer, the team's default wait against a long spin.
source benchmarks/gpu_session/setup.sh || exit 1
gpu_suite 230
engine_step llama8 160 --models llama3-8b --budgets 8 --batch-sizes 1,64 --repeat 2 --deadline-s 130 --run-limit-s 8 \
  --log-steps
grep -E "planning process|reconfigured|copied .* row-major|step: .*, [0-9]{3,}\.[0-9] ms:" $OUT/llama8.log | cut -c1-170 | head -20
for THREADS in 15 16; do
  timeout 40 python3 -m benchmarks.kernel_revisions --against .kernel-before-shares.c --experts-only --threads $THREADS \
    --json $OUT/kernel_shares_$THREADS.json > /tmp/kernel_shares_$THREADS.log 2>&1; echo "kernel shares ($THREADS) rc $?"
  grep -v INFO /tmp/kernel_shares_$THREADS.log | tail -4
done
for SPIN in default 20000000; do
  if [ $SPIN = default ]; then unset GOMP_SPINCOUNT; else export GOMP_SPINCOUNT=$SPIN; fi
  timeout 90 python3 -m benchmarks.kernel_gap --threads 15 --layers 2 --json $OUT/kernel_gap_$SPIN.json > /tmp/kernel_gap_$SPIN.log 2>&1
  echo "kernel_gap ($SPIN) rc $?"; grep -v "kernel:" /tmp/kernel_gap_$SPIN.log | tail -3 | cut -c25-200
done
unset GOMP_SPINCOUNT
cat $OUT/commit.txt $OUT/machine.txt; rm -f $OUT/commit.txt $OUT/machine.txt  # (a call brings back ~8 files)
