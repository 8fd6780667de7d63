#!/usr/bin/env bash
# Issue 52's GPU evidence, second and third rounds (one GPU): FLUX.1-dev and Wan2.1-14B transformers (real architectures, random
# values) as GGUF Q8_0/Q4_0 and fp8-scaled files, each way its own process: all on the GPU, chunkflow at the plan's
# setting (streamed blocks decoded ahead of their forward), the same setting decoding in each layer's forward
# (diffusers' way), and diffusers' leaf-level group offloading; outputs compared bit for bit; the plans made on a
# profile `chunkflow calibrate` measured here first (formats' decode rates included). Third round (WAYS default):
# `tight` the fastest setting the planner finds inside the budget (--max-slowdown 1.01), `phases` each phase of the
# step on its own against the plan (compute in bf16, the link alone; the decode as gpu less compute), and the run
# report's decode probe on every offloaded way; `chunkflow` (decoding ahead) left out: slower on FLUX in round two.
#   PARTS="calib flux" bash docs/data/gpu-formats/gpu_formats.sh OUT_DIR     (then PARTS="wan" ... with PROFILE=)
set -uo pipefail
dest=${1:-${OUT:-out}}
work=${WORK:-/tmp/formats-evidence}
mkdir -p "$work" "$dest"
repo=$(cd "$(dirname "$0")/../../.." && pwd)
b="${PY:-python3} $repo/scripts/format_bench.py"
step() { local name=$1 deadline=$2; shift 2; echo "[$(date +%T)] $*" | tee "$work/$name.log"
  timeout "$deadline" "$@" >>"$work/$name.log" 2>&1; local rc=$?; echo "[$(date +%T)] $name exit $rc" | tee -a "$work/$name.log"; tail -2 "$work/$name.log" | cut -c1-400; }
keep() { tar czf "$dest/formats.tgz" --exclude="*.gguf" --exclude="*.safetensors" --exclude="*.pt" -C "$work" . ; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$work/gpu.txt" 2>&1
PARTS=${PARTS:-calib flux wan}
profile=${PROFILE:-$work/profile.yaml}
export CHUNKFLOW_BENCH_PROFILE=$profile
for part in $PARTS; do
  case $part in
  calib)
    step decode 90 $b decode "$work/decode.json"
    step calibrate 300 python3 -m chunkflow calibrate --model flux,wan2.2 --out "$work/profile.yaml" \
      --raw "$work/calibration.json" --no-save
    cp "$work/profile.yaml" "$dest/profile.yaml" 2>/dev/null; keep ;;
  flux|wan)
    budget=$([ $part = flux ] && echo 6GB || echo 12GB)
    for f in ${FORMATS:-q8_0 fp8-scaled q4_0}; do
      step write-$part-$f 200 $b write "$work" --model $part --format $f ${TINY:+--tiny}
      for w in ${WAYS:-gpu forward tight phases leaf}; do
        rep=$([ $part = flux ] && echo 8 || echo 2)
        step time-$w-$part-$f 200 $b time "$work" "$work/time-$w-$part-$f.json" --model $part --format $f --way $w \
          --mem-budget $budget --repeat $rep ${TINY:+--tiny}
        keep
      done
      rm -f "$work/$part-$f.gguf" "$work/$part-$f.safetensors"
    done ;;
  esac
done
step compare 120 $b compare "$work" "$work/compare.json"
keep
