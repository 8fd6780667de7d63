#!/usr/bin/env bash
# Issue 41's GPU evidence on one H200: calibrate twice (constants within each other's bands?), then three held-out
# plans made with the first profile run through `chunkflow run` (each measurement inside its band?).
#   bash docs/data/h200-bands/gpu_h200_bands.sh OUT
set -u
OUT=${1:?OUT}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CHUNKFLOW_CONFIG_DIR="$OUT/config"
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/log.txt"; }
step() { local limit=$1; shift; log "$*"; timeout "$limit" "$@" >>"$OUT/log.txt" 2>&1; local rc=$?; log "rc=$rc"; return 0; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, diffusers; print(torch.__version__, diffusers.__version__)" >> "$OUT/gpu.txt" 2>&1
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
