# Sourced by each call: the carried wheels (.whl, see benchmarks/README.md) and the paths.

# engine_step NAME SECONDS ARGS...: benchmarks.engine_bench with ARGS and the profile ($PROFILE, else the
# H200 one) under `timeout SECONDS`, its JSON and log as $OUT/NAME.json/.log; then its rc and summary.
engine_step() {
  local name=$1 seconds=$2; shift 2
  timeout "$seconds" python3 -m benchmarks.engine_bench "$@" --profile "${PROFILE:-docs/profiles/h200-run26b.json}" \
    --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1; echo "$name rc $?"
  python3 benchmarks/gpu_session/engine_summary.py "$OUT/$name.json" 2>&1 | tail -6
}

# switch_runs VAR "VALUES" NAME SECONDS ARGS...: engine_step NAME_VALUE_I (I counting from 1) once per VALUE of
# VALUES, with VAR=VALUE in its environment: an A/B of a switch, one process each.
switch_runs() {
  local var=$1 values=$2 name=$3 seconds=$4; shift 4
  local i=0 value
  for value in $values; do
    i=$((i + 1))
    ( export "$var=$value"; engine_step "${name}_${value}_$i" "$seconds" "$@" )
  done
}

# gpu_suite SECONDS: every gpu-marked test under `timeout SECONDS`, its output as $OUT/pytest_gpu.txt; then its
# rc, summary and failures (-rfE: the FAILED lines the grep below shows; -rs alone printed none, session 47).
gpu_suite() {
  timeout "$1" python3 -m pytest -m gpu -q -rfEs --tb=short -p no:cacheprovider --durations=10 > $OUT/pytest_gpu.txt 2>&1
  echo "suite rc $?"; tail -3 $OUT/pytest_gpu.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest_gpu.txt | cut -c1-250
}

# step_summary JSON: each placement of a benchmarks.step_profile result: wall, host compute and predicted ms.
step_summary() {
  python3 - "$1" <<'PY'
import json, os, sys
if os.path.exists(sys.argv[1]):
    data = json.load(open(sys.argv[1]))
    for r in data if isinstance(data, list) else data.get("results", data.get("placements", [])):
        print(r.get("placement"), "wall", round(r.get("wall_ms", 0), 1), "host compute", round(r.get("host_compute_ms", 0), 1),
              "predicted", round(r.get("predicted_ms", 0), 1), "predicted cpu", round(r.get("predicted_cpu_busy_ms", 0), 1),
              "parts GB/s", round(r.get("split_part_gbps", 0), 1), "copies GB/s", round(r.get("copy_gbps", 0), 1))
PY
}

# moe_ahead_runs "MODES" STEPS: qwen3-30b-a3b at 8 GiB, planned and experts-cpu, one process per VRAMSHARD_RUN_AHEAD
# mode in MODES (e.g. "off on off on"), STEPS decode steps each; JSON and log as $OUT/moe_ahead_MODE_N.*.
moe_ahead_runs() {
  local fields="'placement': '[^']*'|'decode_tok_s': [0-9.]*|'predicted_decode_tok_s': [0-9.]*|'bound_tok_s': [0-9.]*|'decode_step_ms': [0-9.]*|'decode_worker_team': [0-9]*"
  local i=0 ahead
  for ahead in $1; do
    i=$((i + 1))
    VRAMSHARD_RUN_AHEAD=$ahead timeout 85 python3 -m benchmarks.moe_bench --budgets 8 --batches 1 --time-limit 65 \
      --no-skewed --decode-steps "$2" --placements planned,experts-cpu --profile "$PROFILE" \
      --out $OUT/moe_ahead_${ahead}_$i.json > $OUT/moe_ahead_${ahead}_$i.log 2>&1
    echo "run-ahead $ahead rc $? load $(cut -d' ' -f1-3 /proc/loadavg)"
    grep -oE "$fields" $OUT/moe_ahead_${ahead}_$i.log | tr '\n' ' ' | sed 's/.placement/\n&/g'; echo
  done
}

# host_profile NAME DIR: unless the caller named a profile ($ASKED_PROFILE, set before sourcing this, as setup sets
# PROFILE below), a quick profile of this host as bench_out/NAME.json (its log and the file in DIR; kept while the
# machine is warm), exported as PROFILE: prices compared with steps need the host's own figures (fifty-seventh
# session: one row priced 43.2 ms from another host's profile, 63.6 from its own, 70.6 measured).
host_profile() {
  if [ -n "${ASKED_PROFILE:-}" ]; then export PROFILE=$ASKED_PROFILE; return; fi
  mkdir -p bench_out "$2"
  timeout ${PROFILE_S:-150} python3 -m vramshard.cli.main profile --quick --out "bench_out/$1.json" > "$2/profile.log" 2>&1
  echo "quick profile rc $?"; cp "bench_out/$1.json" "$2/" 2>/dev/null
  python3 -m vramshard.cli.main profile --show --out "bench_out/$1.json" 2>&1 | head -8
  export PROFILE=bench_out/$1.json
}

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site:src:. PYTHONUNBUFFERED=1
# The profile measured on this kind of card, unless the caller named one. The H200's is the forty-fourth GPU
# session's (session 48's code: the run-ahead worker's experts as one C call); h200-run33.json, made before that,
# priced experts-cpu at 84.8 ms a qwen3-30b-a3b step where it ran 59.2 (forty-fifth session) and ranked it last.
if [ -z "${PROFILE:-}" ]; then
  case "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)" in
    *H100*) export PROFILE=docs/profiles/h100-run40.json ;;
    *H200*) export PROFILE=docs/profiles/h200-run49.json ;;
  esac
fi
echo "profile ${PROFILE:-docs/profiles/h200-run26b.json}"
# (The device's copy may carry the .git of an earlier commit than its files: the files changed since it follow.)
{ git log --oneline -1; git status --short --untracked-files=no | head -40; } > "$OUT/commit.txt" 2>/dev/null || true
# Which machine ran the call (calls of one session may get different ones with one fingerprint).
# The CPU's matrix instructions too: hosts of one fingerprint differ there (bf16 products at 64 rows ran 3.5x
# slower on session 53's host than on the one profiled in session 40).
isa_flags() { grep -m1 -ow "flags.*" /proc/cpuinfo | tr ' ' '\n' | grep -E "^(amx|avx512_bf16|avx512_fp16|avx512f$)"; }
{ hostname; cat /proc/sys/kernel/random/boot_id; nproc; grep -m1 "model name" /proc/cpuinfo;
  isa_flags | sort -u | tr '\n' ' '; echo; lscpu 2>/dev/null | grep -E "^(Thread|Core|Socket|L3|Model:|CPU family)";
} > "$OUT/machine.txt" 2>/dev/null || true
