#!/usr/bin/env bash
# The one-H200 evidence, through the product: calibrate this GPU, then one `chunkflow bench` per model with the
# calibrated profile (docs/runtime-h200.md and docs/planner-accuracy-h200.md are written from what it leaves).
#
#   bash scripts/gpu_h200.sh OUT_DIR          # on one GPU; about 8 minutes on an H200
#   QUICK=1 bash scripts/gpu_h200.sh OUT_DIR  # the tiny model on the CPU: a dry run of every step
#
# Each step has a deadline (a step cut short leaves bench.partial.csv); everything is packed into OUT_DIR/h200.tgz.
set -uo pipefail
out=${1:-${OUT:-out}}/h200
mkdir -p "$out"
cf=${CHUNKFLOW:-python3 -m chunkflow}
source "$(dirname "$0")/run_step.sh"  # run NAME DEADLINE_S ARGS...
if [ -n "${QUICK:-}" ]; then
  run calibrate 120 calibrate --cpu-smoke --out "$out/profile.yaml" --raw "$out/calibration.json" --no-save
  run wan 120 bench --model tiny --frames 5,9 --baselines diffusers-group --hardware "$out/profile.yaml" --out "$out/wan"
else
  run calibrate 120 calibrate --model wan2.2,flux,hunyuan --out "$out/profile.yaml" --raw "$out/calibration.json" --no-save
  run wan 150 bench --model wan2.2 --frames 41,81,121 --height 704 --width 1280 --baselines diffusers-group \
      --warmup 2 --steps 5 --hardware "$out/profile.yaml" --out "$out/wan"
  run flux 180 bench --model flux --batch 1,4,8 --warmup 2 --steps 5 --hardware "$out/profile.yaml" --out "$out/flux"
  run hunyuan 300 bench --model hunyuan --frames 9,21,33 --height 720 --width 1280 --warmup 2 --steps 5 \
      --hardware "$out/profile.yaml" --out "$out/hunyuan"
fi
tar czf "$out/../h200.tgz" -C "$out/.." h200 && echo "packed $(dirname "$out")/h200.tgz"
