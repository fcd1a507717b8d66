# ~6 min: the report's part dense-nemo-a (Table 4, nemo-8b fp16 at 2/4/6 GiB x 1K/4K/16K), which
# last ran on eighth-session code, planned from PROFILE. Bring $OUT/report-dense-nemo-a.json back into
# docs/runs/<date>-<part>/ and merge (benchmarks/README.md, "Report parts").
source benchmarks/gpu_session/setup.sh || exit 1
PROFILE=${PROFILE:-docs/profiles/h200-run15.json}; PART=${PART:-dense-nemo-a}
timeout 560 python3 -m benchmarks.report --part $PART --profile $PROFILE --out $OUT > $OUT/report-$PART.log 2>&1; echo "rc $?"
tail -25 $OUT/report-$PART.log | cut -c1-240
