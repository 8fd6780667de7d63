#!/usr/bin/env bash
# The CPU seconds (user + sys, from /usr/bin/time) of `chunkflow plan` and the command line's --help, whole processes,
# for this checkout against an earlier commit (issue 53: a catalog plan in at most 0.5 s of CPU, --help under 0.5 s).
# Each command runs once to warm up, then RUNS times, alternating the two trees; it prints min / median / max.
# Bytecode is cached (in a temporary PYTHONPYCACHEPREFIX), as in an installed package.
#
#   scripts/bench_plan_speed.sh [BASE_COMMIT] [RUNS]        (default: 6d00250, the commit before issue 53's work; 5)
#   PYTHON=/path/to/python scripts/bench_plan_speed.sh ...  (default: .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${1:-6d00250}
RUNS=${2:-5}
PY=${PYTHON:-.venv/bin/python}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$TMP/base"
git archive "$BASE" src models.yaml hardware.yaml | tar -x -C "$TMP/base"  # its data/ links resolve inside
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX="$TMP/pycache" COLUMNS=120

COMMANDS=(
  "plan --model wan2.1-14b --frames 81 --height 480 --width 832 --mem-budget 16GB --host-mem-budget 64GB"
  "plan --model wan2.1-14b --mem-budget 24GB"
  "plan --model flux --mem-budget 24GB"
  "plan --model wan2.1-14b --frames 33 --height 320 --width 576 --mem-budget 12GB --hardware rtx-4090"
  "plan --model wan2.1-14b --format q8_0,q4_k,bf16 --mem-budget 24GB"
  "plan --model qwen --mem-budget 16GB --hardware rtx-5090 --host-mem-budget 64GB --allow-fp8"
  "--help"
  "plan --help"
  "run --help"
)

cpu_s() {  # SRC ARGS...: one whole process's user + sys seconds
  local src=$1; shift
  PYTHONPATH="$src" /usr/bin/time -f "%U %S" -o "$TMP/t" "$PY" -m chunkflow "$@" >/dev/null 2>&1 || true
  tail -n 1 "$TMP/t" | awk '{printf "%.2f\n", $1 + $2}'  # the last line: before it, a non-zero exit's
}

stats() {  # numbers on stdin -> "min median max"
  sort -n | awk '{a[NR]=$1} END {printf "%.2f %.2f %.2f", a[1], (NR % 2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2), a[NR]}'
}

echo "# chunkflow plan speed: CPU seconds (user + sys) of whole processes, $RUNS runs after one warm-up"
echo "# $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) CPUs ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)),"
echo "# $("$PY" --version), base $BASE vs $(git rev-parse --short HEAD)$(git diff --quiet || echo ' (modified)')"
printf "%-100s %-17s %-17s %s\n" "command" "base min/med/max" "now min/med/max" "now/base"
for cmd in "${COMMANDS[@]}"; do
  read -r -a args <<<"$cmd"
  cpu_s "$TMP/base/src" "${args[@]}" >/dev/null
  cpu_s src "${args[@]}" >/dev/null
  : >"$TMP/a"; : >"$TMP/b"
  for _ in $(seq "$RUNS"); do
    cpu_s "$TMP/base/src" "${args[@]}" >>"$TMP/a"
    cpu_s src "${args[@]}" >>"$TMP/b"
  done
  a=$(stats <"$TMP/a"); b=$(stats <"$TMP/b")
  ratio=$(awk -v x="${b#* }" -v y="${a#* }" 'BEGIN {split(x, p, " "); split(y, q, " "); printf "%.2f", p[1] / q[1]}')
  printf "%-100s %-17s %-17s %s\n" "chunkflow $cmd" "${a// //}" "${b// //}" "$ratio"
done
