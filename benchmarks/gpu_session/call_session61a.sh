# ~6 min (written 2026-12-07 in session 60; `timeout_s` 480). A full profile alone, now with what ran on the CPUs
# beside each table (`host_beside`: other processes' cores and the virtual machine's steal, /proc/stat), kept on the
# machine as bench_out/profile-run61a.json for call_session61b.sh (the profile check against it, same boot) and
# returned as $OUT/profile.json. The fifty-fifth session's two full profiles of one boot put the CPU peaks 6.6-51.4%
# apart while the check's CPU probe moved 2.4x; this says whether the host's other guests took the CPUs meanwhile.
source benchmarks/gpu_session/setup.sh || exit 1
mkdir -p bench_out
timeout ${PROFILE_S:-450} python3 -m vramshard.cli.main profile --out $OUT/profile.json > $OUT/profile.log 2>&1
echo "profile rc $?"; cp $OUT/profile.json bench_out/profile-run61a.json
python3 -m vramshard.cli.main profile --show --out $OUT/profile.json 2>&1 | head -20
