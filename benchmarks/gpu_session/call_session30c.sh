# ~8.5 min on a fresh machine (written 2026-12-05 in session 30). 1. The GPU tests of session 30's changes:
# exact-size pinned host buffers (mmap + cudaHostRegister; the zero-copy experts read host experts through
# that mapping), the prefix cache, split FFNs. 2. benchmarks.pinned_host: resident memory and H2D rate,
# torch's allocator against exact. 3. nemo-8b at 8 GiB, prepacked CPU parts against the default (the
# fifteenth session's 10.40 tok/s had them; the twenty-sixth's 6.50 did not). The prefix cache's
# benchmark is left to call_session30a.sh (a session's 30 minutes had 14 left when this was written).
source benchmarks/gpu_session/setup.sh || exit 1
timeout 170 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/test_pinned_host.py tests/test_prefix_cache.py \
  tests/test_zero_copy_experts.py tests/test_split_ffn.py "tests/test_moe.py::test_gpu_moe_host_experts_read_by_the_gpu_from_pinned_memory_match_cpu" > $OUT/pytest_gpu.txt 2>&1; echo "gpu tests rc $?"; tail -4 $OUT/pytest_gpu.txt
timeout 60 python3 -m benchmarks.pinned_host --json $OUT/pinned_host.json > $OUT/pinned_host.log 2>&1; echo "pinned rc $?"
grep -E "MB:" $OUT/pinned_host.log
for way in packed auto; do
  if [ $way = packed ]; then export VRAMSHARD_CPU_PACKED=on; else export VRAMSHARD_CPU_PACKED=off; fi
  timeout 150 python3 -m benchmarks.engine_bench --models nemo-8b --budgets 8 --batch-sizes 1 --deadline-s 90 \
    --run-limit-s 12 --profile ${PROFILE:-docs/profiles/h200-run26b.json} \
    --out $OUT/nemo_decode_$way.json > $OUT/nemo_decode_$way.log 2>&1; echo "$way rc $?"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d.get('bandwidth_gb_s')); [print(c.get('engine'), c.get('vram'), c.get('tg_tok_s'), c.get('decode_host_compute_ms_median'), c.get('error','')) for m in d['models'].values() for c in m['cells']]" $OUT/nemo_decode_$way.json 2>&1 | tail -4
  grep -E "took \{1:|built and pinned" $OUT/nemo_decode_$way.log | cut -c1-300 | head -3
done
unset VRAMSHARD_CPU_PACKED
