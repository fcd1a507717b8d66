# Sourced by each call: the carried wheels (.whl, see benchmarks/README.md) and the paths.

# engine_step NAME SECONDS ARGS...: benchmarks.engine_bench with ARGS and the profile ($PROFILE, else the
# H200 one) under `timeout SECONDS`, its JSON and log as $OUT/NAME.json/.log; then its rc and summary.
engine_step() {
  local name=$1 seconds=$2; shift 2
  timeout "$seconds" python3 -m benchmarks.engine_bench "$@" --profile "${PROFILE:-docs/profiles/h200-run26b.json}" \
    --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1; echo "$name rc $?"
  python3 benchmarks/gpu_session/engine_summary.py "$OUT/$name.json" 2>&1 | tail -6
}

# gpu_suite SECONDS: every gpu-marked test under `timeout SECONDS`, its output as $OUT/pytest_gpu.txt; then its
# rc, summary and failures.
gpu_suite() {
  timeout "$1" python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=10 > $OUT/pytest_gpu.txt 2>&1
  echo "suite rc $?"; tail -3 $OUT/pytest_gpu.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest_gpu.txt | cut -c1-250
}

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site:src:. PYTHONUNBUFFERED=1
# The profile measured on this kind of card, unless the caller named one.
if [ -z "${PROFILE:-}" ]; then
  case "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)" in
    *H100*) export PROFILE=docs/profiles/h100-run40.json ;;
    *H200*) export PROFILE=docs/profiles/h200-run33.json ;;
  esac
fi
echo "profile ${PROFILE:-docs/profiles/h200-run26b.json}"
git log --oneline -1 > "$OUT/commit.txt" 2>/dev/null || true
# Which machine ran the call (calls of one session may get different ones with one fingerprint).
{ hostname; cat /proc/sys/kernel/random/boot_id; nproc; grep -m1 "model name" /proc/cpuinfo; } > "$OUT/machine.txt" 2>/dev/null || true
