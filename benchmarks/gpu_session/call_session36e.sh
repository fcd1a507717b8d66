# ~3.5 min (written 2026-12-05 in session 36). Session 36's C kernel (the next block's rows prefetched, the routed
# experts' down rows in runs) against session 35's on this host, in one process, with the host's read: one
# Qwen3-30B-A3B layer's routed experts at 1, 4 and 16 tokens, an 8B FFN's one- and four-row products in bf16 and
# fp16. Session 35's source must be in the tree first (untracked files are carried; there is no git history):
#   git show 669130e:src/vramshard/layers/cpu_gemv.c > .kernel-669130e.c
source benchmarks/gpu_session/setup.sh || exit 1
[ -f .kernel-669130e.c ] || { echo "missing .kernel-669130e.c (see the top of this script)"; exit 1; }
timeout 150 python3 -m benchmarks.kernel_revisions --against .kernel-669130e.c --json $OUT/kernel_revisions.json \
  > $OUT/kernel_revisions.log 2>&1; echo "kernel_revisions rc $?"; grep -v INFO $OUT/kernel_revisions.log | tail -14
# The kernel against oneDNN's prepacked weights and F.linear at 1, 2 and 4 rows (since session 36 the kernel takes
# dense FFN work of up to 4 rows; VRAMSHARD_CPU_GEMV_ROWS=1 gives it one row only, as before).
for DT in bf16 fp16; do
  timeout 75 python3 -m benchmarks.cpu_gemv --dtype $DT --rows 1,2,4 --out $OUT/cpu_gemv_$DT.json > $OUT/cpu_gemv_$DT.log 2>&1
  echo "cpu_gemv $DT rc $?"; grep -v INFO $OUT/cpu_gemv_$DT.log | grep -oE "'shape': '[^']*'|'rows': [0-9]+|'[a-z]+_gb_s': [0-9.]+" | tr '\n' ' ' | sed "s/'shape'/\n&/g"; echo
done
