# ~9.5 min (written 2026-12-05 in session 32). A full profile whose one-row CPU tables go through the C
# decode kernel (and compile no one-token projections); each table's start is logged (-v). Keep
# $OUT/profile.json as docs/profiles/h100-run33.json for call_session33c.sh (PROFILE=).
source benchmarks/gpu_session/setup.sh || exit 1
timeout 560 python3 -m vramshard.cli.main -v profile --out $OUT/profile.json > $OUT/profile.log 2>&1; echo "profile rc $?"
grep -E "profiling |profile written|measured in" $OUT/profile.log | cut -c1-160 | tail -40
