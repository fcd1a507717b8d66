# ~8 min (written 2026-12-06 in session 39). A full profile of this machine with session 39's code: the worker's
# expert pass now timed beside a host thread that launches work (host_experts_worker_beside), the zero-copy table.
# Keep $OUT/profile.json as docs/profiles/h100-runNN.json (or h200-runNN.json) and plan the next calls with it.
source benchmarks/gpu_session/setup.sh || exit 1
rm -f $OUT/commit.txt $OUT/machine.txt
S=$(date +%s)
timeout 560 python3 -m vramshard.cli.main profile --out $OUT/profile.json > /tmp/profile.log 2>&1
echo "profile rc $? in $(( $(date +%s) - S )) s"; tail -3 /tmp/profile.log | cut -c1-200
python3 -c "
import json; d = json.load(open('$OUT/profile.json'))
print('worker beside', d.get('host_experts_worker_beside'), 'zero_copy', d.get('zero_copy'))
print('host_experts', d.get('host_experts')); print('worker', d.get('host_experts_worker'))
print('teams', d.get('host_experts_worker_teams'))"
