#!/usr/bin/env bash
# Issue 52's GPU evidence (one GPU): FLUX.1-dev's transformer (real architecture, random quant blocks) as a GGUF file
# in Q8_0 then Q4_0, diffusers' own module from the file (from_single_file + GGUFQuantizationConfig), a 1024x1024
# forward each way in its own process: all on the GPU, chunkflow at the plan's setting for --mem-budget 6GB, and
# diffusers' leaf-level group offloading (streams on); outputs compared bit for bit; diffusers' dequantization rate
# per type.    bash docs/data/gpu-gguf/gpu_gguf.sh OUT_DIR
set -uo pipefail
dest=${1:-${OUT:-out}}
work=${WORK:-/tmp/gguf-evidence}
mkdir -p "$work" "$dest"
repo=$(cd "$(dirname "$0")/../../.." && pwd)
b="python3 $repo/scripts/gguf_bench.py"
step() { local name=$1 deadline=$2; shift 2; echo "[$(date +%T)] $*" | tee "$work/$name.log"
  timeout "$deadline" "$@" >>"$work/$name.log" 2>&1; local rc=$?; echo "[$(date +%T)] $name exit $rc" | tee -a "$work/$name.log"; tail -2 "$work/$name.log"; }
keep() { tar czf "$dest/gguf.tgz" --exclude="*.gguf" --exclude="*.pt" -C "$work" . ; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$work/gpu.txt" 2>&1
step decode 60 $b decode "$work/decode.json"
for q in ${QTYPES:-q8_0 q4_0}; do
  step write-$q 150 $b write "$work" --qtype $q
  for w in ${WAYS:-gpu chunkflow leaf}; do
    step time-$w-$q 150 $b time "$work" "$work/time-$w-$q.json" --qtype $q --way $w
    keep
  done
  rm -f "$work/$q.gguf"
done
step compare 60 $b compare "$work" "$work/compare.json"
keep
