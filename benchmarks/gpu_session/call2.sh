# ~9.5 min: the profile check, the full profile now measuring its CPU tables in two rounds and
# dense FFNs from prepacked weights; its file comes back as profile_run1.json.
source benchmarks/gpu_session/setup.sh || exit 1
timeout 585 python3 benchmarks/profile_check.py --second-quick --budget-s 570 --out $OUT/profile_check.json > $OUT/profile_check.log 2>&1; echo "rc $?"
grep -E "^run |within 20%|drift|peak cpu|total" $OUT/profile_check.log | cut -c1-400
