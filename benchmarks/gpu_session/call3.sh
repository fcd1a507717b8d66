# ~9 min: the profile check, the full profile now measuring its CPU tables in two rounds.
source benchmarks/gpu_session/setup.sh || exit 1
timeout 570 python3 benchmarks/profile_check.py --budget-s 540 --out $OUT/profile_check.json > $OUT/profile_check.log 2>&1; echo "rc $?"
grep -E "^run |within 20%|drift|peak cpu|total" $OUT/profile_check.log | cut -c1-400
