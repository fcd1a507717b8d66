# ~8 min (written 2026-12-07 in session 59). Every gpu-marked test on session 58's tree (none of its GPU-side changes
# had run the whole suite), then a full profile of this machine (its graph replay and VRAM decode tables measured
# for the first time in a full profile; kept as docs/profiles/h100-run59.json where the card is an H100).
source benchmarks/gpu_session/setup.sh || exit 1
[ "${SUITE_S:-300}" != 0 ] && gpu_suite ${SUITE_S:-300}
timeout ${PROFILE_S:-270} python3 -m vramshard.cli.main profile --out $OUT/profile.json > $OUT/profile.log 2>&1
echo "profile rc $?"; tail -5 $OUT/profile.log | cut -c1-300
timeout 60 python3 -m vramshard.cli.main profile --show --out $OUT/profile.json 2>&1 | head -60 | cut -c1-200
