#!/usr/bin/env bash
# The one-H200 evidence that an offloaded model stays a normal model (issue 12), through the product:
#   compiled  chunkflow bench --compile regional: compiled no offload, compiled chunkflow (16 MB, r = 0) and compiled
#             diffusers group offloading, Wan2.2-TI2V-5B at 704x1280, 81 and 121 frames, bit-identity checked
#   eager     the same model uncompiled at 41/81/121 frames (the runtime's hot path against docs/runtime-h200.md)
#   soak      chunkflow run: 500 denoising steps of two forwards (1000 consecutive forwards) at r = 0.3,
#             memory after every step in the run report
#
#   bash docs/data/h200-fidelity/gpu_h200_fidelity.sh OUT_DIR            # on one GPU; about 8 minutes on an H200
#   QUICK=1 bash docs/data/h200-fidelity/gpu_h200_fidelity.sh OUT_DIR    # the tiny model on the CPU: a dry run of every step
#
# Each step has a deadline; everything is packed into OUT_DIR/fidelity.tgz.
set -uo pipefail
out=${1:-${OUT:-out}}/fidelity
mkdir -p "$out"
cf=${CHUNKFLOW:-python3 -m chunkflow}
profile=${PROFILE:-profiles/h200-calibrated.yaml}
repo=$(cd "$(dirname "$0")/../../.." && pwd)
source "$repo/scripts/run_step.sh"  # run NAME DEADLINE_S ARGS...
if [ -n "${QUICK:-}" ]; then
  model=(--model tiny); big=(--frames 5,9); small=(--frames 5); steps=20; profile=h200
else
  model=(--model wan2.2 --height 704 --width 1280); big=(--frames 81,121); small=(--frames 41); steps=500
fi
run compiled 210 bench "${model[@]}" "${big[@]}" --modes none,chunkflow --baselines diffusers-group \
    --compile regional --warmup 2 --steps 5 --hardware "$profile" --out "$out/compiled"
run eager 120 bench "${model[@]}" "${big[@]/81/41,81}" --modes none,layerwise,chunkflow --warmup 2 --steps 5 \
    --hardware "$profile" --out "$out/eager"
if [ -n "${QUICK:-}" ]; then
  run soak-plan 30 plan --model tiny --steps "$steps" --hardware "$profile" --out "$out/soak-plan.json"
else
  run soak-plan 30 plan --model wan2.2 "${small[@]}" --height 480 --width 832 --steps "$steps" --hardware "$profile" \
      --out "$out/soak-plan.json"
fi
run soak 220 run --plan "$out/soak-plan.json" --mode chunkflow --chunk-size 16MB --residency 0.3 --warmup 1 \
    --steps "$steps" --report "$out/soak-report.json"
tar czf "$out/../fidelity.tgz" -C "$out/.." fidelity && echo "packed $(dirname "$out")/fidelity.tgz"
