# ~5 min: the report's part dense-nemo-b (Table 4, nemo-8b fp16 at 8/12/16 GiB), as call 2 does
# dense-nemo-a; PART= runs another part the same way (python -m benchmarks.report --list).
PART=${PART:-dense-nemo-b} bash benchmarks/gpu_session/call2.sh
