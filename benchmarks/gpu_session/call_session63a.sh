# ~7 min (written 2026-12-07 in session 63; `timeout_s` 480; stages keep their files in $OUT/call.tgz as they end).
# Session 63 priced the host's gather of a host KV cache's blocks at the profile's rate (`cpu.gather_gb_s`, else half
# the host's read; a constant 10 GB/s priced the fifty-sixth session's GPU-only 64-sequence step at 935 ms against
# 428-443 measured) and gave the staging two pinned buffers in turn (each gather had waited for the copy in before).
# The fifty-sixth session's steps were priced from another host's profile (h100-run40, read 194 GB/s; that host read
# 90): this call first profiles this host (--quick, ~40-90 s on an H100 host), kept as bench_out/profile-quick63.json.
# 1. The quick profile (unless $PROFILE names one), then this host's read and gather (bench_memory.py), three times.
# 2. step_profile of llama3-8b at 64 rows of 1K context, 8 GiB: the plan the planner chooses, and its gpu-only
#    placement (the one the fifty-sixth session measured), each predicted against measured, twice (ABAB); then one
#    row (planned:8+graphs, twice).
# 3. The GPU tests of the KV staging, the gather and the profile.
ASKED_PROFILE=${PROFILE:-}  # (setup.sh sets PROFILE to a stored profile of the GPU's kind: the fifty-seventh session)
source benchmarks/gpu_session/setup.sh || exit 1
W=/tmp/call63a; mkdir -p $W bench_out
keep() { tar -C $W -czf $OUT/call.tgz . ; }
host_profile profile-quick63 $W
keep
python3 - > $W/gather.txt 2>&1 <<'PY'
import torch
from vramshard.profile.bench_memory import measure_cpu_gather, measure_cpu_read
for _ in range(3):
    print(f"read {measure_cpu_read(0.2) / 1e9:.1f} GB/s gather {measure_cpu_gather(0.2) / 1e9:.1f} GB/s "
          f"threads {torch.get_num_threads()}")
PY
echo "gather rc $?"; cat $W/gather.txt | tail -3; keep
P=planned:8+graphs; G=planned:8/gpu-only+graphs
VRAMSHARD_WIRE_CODEC=on timeout ${STEPS64_S:-150} python3 -m benchmarks.step_profile --shape llama3-8b --seqs 64 \
  --placements $P,$G,$P,$G --profile "$PROFILE" --json $W/steps64.json > $W/steps64.log 2>&1
echo "seqs 64 rc $? load $(cut -d' ' -f1-3 /proc/loadavg)"; step_summary $W/steps64.json; grep -i "planning from" $W/steps64.log
keep
VRAMSHARD_WIRE_CODEC=on timeout ${STEPS1_S:-80} python3 -m benchmarks.step_profile --shape llama3-8b \
  --placements $P,$P --profile "$PROFILE" --json $W/steps1.json > $W/steps1.log 2>&1
echo "seqs 1 rc $? load $(cut -d' ' -f1-3 /proc/loadavg)"; step_summary $W/steps1.json; keep
timeout ${TESTS_S:-100} python3 -m pytest -m gpu -q -rfEs --tb=short -p no:cacheprovider tests/test_kv_staging.py \
  tests/test_host_gather.py tests/test_profile.py > $W/pytest_gpu.txt 2>&1
echo "gpu tests rc $?"; tail -2 $W/pytest_gpu.txt; grep -E "^(FAILED|ERROR)" $W/pytest_gpu.txt | cut -c1-250; keep
ls -la $OUT
