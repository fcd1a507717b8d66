# ~9 min (written 2026-12-06 in session 49). call_session48c.sh (llama3-8b at 2, 4 and 8 GiB against layers:max in
# ABBA order) after session 49's warm-up change, then each cell's switches after its "warm-up done" line: in the
# forty-fourth GPU session every planned cell that re-planned had a fit and two switches in its timed runs; now
# there should be none (a line "the plan in force goes on" is a fit's quick plan kept out: session 49).
bash benchmarks/gpu_session/call_session48c.sh
python3 benchmarks/gpu_session/switches_after_warmup.py $OUT/abba.log | cut -c1-220
