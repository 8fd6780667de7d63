#!/usr/bin/env bash
# Issue 41's GPU evidence on one H200, through the product.
#   part `transformer` (call 1): calibrate twice without the VAE decodes or the disk (scripts/bands_evidence.py
#     calibrate), compare the two (constants against each other's bands), then three held-out plans made with the
#     first profile run through `chunkflow run` with random weights (step time and peak memory against their bands).
#   part `pipeline` (call 2): Wan2.2-TI2V-5B saved with save_pretrained (real architecture, random values);
#     `chunkflow calibrate --model wan2.2 --weights DIR --save` twice in a fresh config directory (the second records
#     each fit's drift against the first); the second against the first's bands (held out: the first carries the
#     drift prior); two held-out whole-pipeline plans from the saved profile, each run from the folder with its page
#     cache dropped (`chunkflow run --weights DIR --prompt ...`, one a process's first generation, one after a warm-up):
#     every phase, the generation, host memory and the load against their bands.
#   part `rerun` (call 3): the two whole-pipeline plans again, from the profile of call 2 with its drift measured as
#     this script's code measures it (run-2/cal4-drift.yaml), and FLUX.1-dev at 1024x1024 8 steps at 6 GB (its folder
#     saved the same way), each a process's first generation after the page cache was dropped except gen-480 (a warm-up).
#   PARTS=transformer bash docs/data/h200-bands/gpu_h200_bands.sh OUT
#   PARTS=pipeline bash docs/data/h200-bands/gpu_h200_bands.sh OUT
#   PARTS=rerun bash docs/data/h200-bands/gpu_h200_bands.sh OUT
set -u
OUT=${1:?OUT}
mkdir -p "$OUT"
repo=$(cd "$(dirname "$0")/../../.." && pwd)
export PYTHONUNBUFFERED=1
wanted() { [ -z "${PARTS:-}" ] || [[ " $PARTS " == *" $1 "* ]]; }
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/log.txt"; }
step() { local limit=$1; shift; log "$*"; timeout "$limit" "$@" >>"$OUT/log.txt" 2>&1; local rc=$?; log "rc=$rc"; return 0; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, diffusers; print(torch.__version__, diffusers.__version__)" >> "$OUT/gpu.txt" 2>&1
if wanted transformer; then
  export CHUNKFLOW_CONFIG_DIR="$OUT/config"
  step 110 python3 scripts/bands_evidence.py calibrate "$OUT/cal1.yaml" "$OUT/cal1.json" --model wan2.2,flux
  step 110 python3 scripts/bands_evidence.py calibrate "$OUT/cal2.yaml" "$OUT/cal2.json" --model wan2.2,flux
  step 20 python3 scripts/bands_evidence.py compare "$OUT/cal1.yaml" "$OUT/cal2.yaml" "$OUT/compare.json"
  plan() { local name=$1; shift; step 20 python3 -m chunkflow plan "$@" --hardware "$OUT/cal1.yaml" --codec off \
      --host-mem-budget 100GB --out "$OUT/$name-plan.json"; }
  plan flux --model flux --height 1024 --width 1024 --steps 8 --mem-budget 6GB
  plan wan-704 --model wan2.2 --frames 41 --height 704 --width 1280 --steps 8 --mem-budget 8GB
  plan wan-480 --model wan2.2 --frames 81 --height 480 --width 832 --steps 8 --mem-budget 4GB
  for name in wan-480 wan-704 flux; do
    [ -f "$OUT/$name-plan.json" ] || continue
    step 90 python3 -m chunkflow run --plan "$OUT/$name-plan.json" --steps 3 --warmup 1 --report "$OUT/$name-report.json"
  done
  step 20 python3 scripts/bands_evidence.py verdicts "$OUT/verdicts.json" "$OUT"/*-report.json
fi
if wanted pipeline; then
  data=${DATA:-/tmp/chunkflow-weights}
  folder=$data/wan22-5b
  export CHUNKFLOW_CONFIG_DIR="$OUT/config"
  rm -rf "$CHUNKFLOW_CONFIG_DIR"
  [ -d "$folder" ] || { rm -rf "$data"; mkdir -p "$data"; step 120 python3 scripts/save_pipeline.py wan2.2 "$folder"; }
  for n in 3 4; do
    step 200 python3 -m chunkflow calibrate --model wan2.2 --weights "$folder" --save --out "$OUT/cal$n.yaml" \
        --raw "$OUT/cal$n.json"
  done
  step 20 python3 scripts/bands_evidence.py compare "$OUT/cal3.yaml" "$OUT/cal4.yaml" "$OUT/compare34.json"
  prompt="a cat walks on the grass"
  gen() { local name=$1 warmup=$2; shift 2
    step 30 python3 -m chunkflow plan --model wan2.2 "$@" --steps 8 --weights "$folder" --codec off \
        --out "$OUT/$name-plan.json"
    [ -f "$OUT/$name-plan.json" ] || return 0
    step 60 python3 scripts/drop_cache.py "$folder"
    step 150 python3 -m chunkflow run --plan "$OUT/$name-plan.json" --weights "$folder" --prompt "$prompt" --seed 0 \
        --warmup "$warmup" --report "$OUT/$name-report.json"; }
  gen gen-704 0 --frames 41 --height 704 --width 1280 --mem-budget 8GB
  gen gen-480 1 --frames 81 --height 480 --width 832 --mem-budget 8GB
  step 20 python3 scripts/bands_evidence.py verdicts "$OUT/verdicts-pipeline.json" "$OUT"/gen-*-report.json
fi
if wanted rerun; then
  data=${DATA:-/tmp/chunkflow-weights}
  profile=$repo/docs/data/h200-bands/run-2/cal4-drift.yaml
  export CHUNKFLOW_CONFIG_DIR="$OUT/config"
  prompt="a cat walks on the grass"
  gen() { local name=$1 warmup=$2 model=$3 folder=$4; shift 4
    step 30 python3 -m chunkflow plan --model $model "$@" --steps 8 --weights "$folder" --codec off \
        --hardware "$profile" --out "$OUT/$name-plan.json"
    [ -f "$OUT/$name-plan.json" ] || return 0
    step 60 python3 scripts/drop_cache.py "$folder"
    step 150 python3 -m chunkflow run --plan "$OUT/$name-plan.json" --weights "$folder" --prompt "$prompt" --seed 0 \
        --warmup "$warmup" --report "$OUT/$name-report.json"; }
  [ -d "$data/wan22-5b" ] || { mkdir -p "$data"; step 120 python3 scripts/save_pipeline.py wan2.2 "$data/wan22-5b"; }
  gen gen-704 0 wan2.2 "$data/wan22-5b" --frames 41 --height 704 --width 1280 --mem-budget 8GB
  gen gen-480 1 wan2.2 "$data/wan22-5b" --frames 81 --height 480 --width 832 --mem-budget 8GB
  step 20 python3 scripts/bands_evidence.py verdicts "$OUT/verdicts-rerun.json" "$OUT"/gen-*-report.json
  rm -rf "$data/wan22-5b"
  step 150 python3 scripts/save_pipeline.py flux "$data/flux"
  gen gen-flux 0 flux "$data/flux" --height 1024 --width 1024 --mem-budget 6GB
  step 20 python3 scripts/bands_evidence.py verdicts "$OUT/verdicts-rerun.json" "$OUT"/gen-*-report.json
fi
