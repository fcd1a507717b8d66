# ~6 min (written 2026-12-06 in session 48). The Profiler issue's repeatability across two calls on one warm
# machine: two full profiles no longer fit one call (317 s each on the forty-third session's host). This call
# measures the first into build/ (ignored: it stays on the warm machine for call_session48b.sh, which must follow
# within the machine's idle release) and brings a copy back. Compare machine.txt's boot ids of the two calls.
source benchmarks/gpu_session/setup.sh || exit 1
mkdir -p build
timeout ${PROFILE_S:-560} python3 -m vramshard.cli.main profile --out build/profile_a.json --show > $OUT/profile_a.log 2>&1
echo "profile rc $?"
cp build/profile_a.json $OUT/ 2>/dev/null
tail -25 $OUT/profile_a.log
