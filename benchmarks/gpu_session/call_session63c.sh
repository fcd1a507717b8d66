# ~9 min (written 2026-12-07 in session 63, after the fifty-seventh GPU session; `timeout_s` 590; stages keep their
# files in $OUT/call.tgz as they end). Session 63's CPU decode batches through the C kernel (one call for every
# sequence whose blocks are consecutive: 6.7x the padded batch at 64 sequences x 1K on the 2-core development
# machine, where the kernel reads at a third of the host's read) on a GPU host's 16 cores, and the plans they change:
# 1. A quick profile of this host (kept as bench_out/profile-quick63c.json while the machine is warm).
# 2. The whole GPU suite (session 63's in-place copies of a page-locked KV cache have not run on a GPU).
# 3. benchmarks.cpu_decode_attention --batches 4,16,64 (the kernel by sequence against the padded batch, the bound).
# 4. step_profile of llama3-8b at 64 rows of 1K context at 2 and 8 GiB, planned from that profile (predicted
#    against measured; at 2 GiB the planner may put attention on the CPU now).
ASKED_PROFILE=${PROFILE:-}
source benchmarks/gpu_session/setup.sh || exit 1
W=/tmp/call63c; mkdir -p $W bench_out
keep() { tar -C $W -czf $OUT/call.tgz . ; }
host_profile profile-quick63c $W
keep
gpu_suite ${SUITE_S:-240}; cp $OUT/pytest_gpu.txt $W/; keep
timeout ${ATTN_S:-90} python3 -m benchmarks.cpu_decode_attention --lengths 1024,4096 --batches 4,16,64 \
  --json $W/cpu_decode_attention.json > $W/cpu_decode_attention.log 2>&1
echo "cpu_decode_attention rc $?"; grep -E "positions" $W/cpu_decode_attention.log | cut -c25-220; keep
for gib in 2 8; do
  VRAMSHARD_WIRE_CODEC=on timeout ${STEPS64_S:-120} python3 -m benchmarks.step_profile --shape llama3-8b --seqs 64 \
    --placements planned:$gib+graphs,planned:$gib+graphs --profile "$PROFILE" --json $W/steps64_$gib.json \
    > $W/steps64_$gib.log 2>&1
  echo "seqs 64 at $gib GiB rc $?"; step_summary $W/steps64_$gib.json; keep
done
ls -la $OUT
