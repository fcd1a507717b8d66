# ~5 min: the one Table 4 nemo-8b cell the part's time limit left empty (layers:max at 6 GiB / 16K),
# as a cell re-run of dense-nemo-a; merged, its cells replace the whole run's.
source benchmarks/gpu_session/setup.sh || exit 1
PROFILE=${PROFILE:-docs/profiles/h200-run15.json}
timeout 330 python3 -m benchmarks.report --part dense-nemo-a --budgets 6 --contexts 16384 --profile $PROFILE --out $OUT \
  > $OUT/report-dense-nemo-a-6gib-16k.log 2>&1; echo "rc $?"
grep -o "'system': '[a-z:-]*', 'budget_gib': [0-9.]*, 'context': [0-9]*.\{0,80\}" $OUT/report-dense-nemo-a-6gib-16k.log | cut -c1-200
