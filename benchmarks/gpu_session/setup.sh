# Sourced by each call: the carried wheels (.whl, see benchmarks/README.md) and the paths.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site:src:. PYTHONUNBUFFERED=1
git log --oneline -1 > "$OUT/commit.txt" 2>/dev/null || true
# Which machine ran the call (calls of one session may get different ones with one fingerprint).
{ hostname; cat /proc/sys/kernel/random/boot_id; nproc; grep -m1 "model name" /proc/cpuinfo; } > "$OUT/machine.txt" 2>/dev/null || true
