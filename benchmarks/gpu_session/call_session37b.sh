# ~7 min (written 2026-12-05 in session 37). Why the GPU's zero-copy reads of routed experts ran at 58% of PCIe
# in the thirty-second session (qwen3-30b-a3b at 8 GiB, experts-zero-copy: 8.81 tok/s on an H100 machine, against
# 12.5-12.6 on the H200 machine in the fifteenth to twenty-fifth sessions): the machine type changed, and since
# session 36 the pinned host weights ask for 2 MiB pages. Note which card this call gets. First one
# layer's routed experts read by the kernels from cudaHostAlloc'd memory, from the executor's on 2 MiB pages and on
# 4 KiB pages, against the copy engine; then the experts-zero-copy cell with each kind of page; then the MoE cells
# with the C kernel off (that run stopped in moe_bench's report in the thirty-second session).
source benchmarks/gpu_session/setup.sh || exit 1
timeout 90 python3 -m benchmarks.zero_copy --experts --host-memory torch,huge,small --json $OUT/zero_copy_pages.json \
  > $OUT/zero_copy_pages.log 2>&1; echo "zero_copy rc $?"; grep "'tokens'" $OUT/zero_copy_pages.log | cut -c25-
FIELDS="'placement': '[^']*'|'decode_tok_s': [0-9.]*|'predicted_decode_tok_s': [0-9.]*|'bound_tok_s': [0-9.]*|'pcie_bound_tok_s': [0-9.]*"
for PAGES in huge small; do
  VRAMSHARD_HOST_PAGES=$PAGES VRAMSHARD_RUN_AHEAD=on timeout 110 python3 -m benchmarks.moe_bench --budgets 8 --batches 1 \
    --time-limit 90 --no-skewed --placements experts-zero-copy --profile "${PROFILE:-docs/profiles/h200-run33.json}" \
    --out $OUT/moe_pages_$PAGES.json > $OUT/moe_pages_$PAGES.log 2>&1
  echo "moe zero-copy ($PAGES pages) rc $?"; grep -oE "$FIELDS" $OUT/moe_pages_$PAGES.log | tr '\n' ' '; echo
done
VRAMSHARD_CPU_GEMV=off VRAMSHARD_RUN_AHEAD=on timeout 170 python3 -m benchmarks.moe_bench --budgets 8 --batches 1 \
  --time-limit 150 --no-skewed --placements planned,experts-cpu --profile "${PROFILE:-docs/profiles/h200-run33.json}" \
  --out $OUT/moe_gemv_off.json > $OUT/moe_gemv_off.log 2>&1
echo "moe (C kernel off) rc $?"; grep -oE "$FIELDS" $OUT/moe_gemv_off.log | tr '\n' ' ' | sed 's/.placement/\n&/g'; echo
