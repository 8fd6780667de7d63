#!/usr/bin/env bash
# Issues 14 and 15 checked out of sample on one H200, through the product, in parts that fit a device call each:
#   cast       the fp8 cast kernel on this GPU: its tests (tests/test_fp8cast.py, bit for bit against PyTorch's cast)
#   calibrate  `chunkflow calibrate` (tiled VAE decodes now timed per decoder call at two resolutions); the profile
#              every later part plans with (or PROFILE=p.yaml: a profile an earlier call wrote)
#   qwen       issue 15: Qwen-Image 1328x1328 in 24 GB planned at --max-slowdown 1.10 and run, with no offload for
#              reference (docs/data/h200-levers/gpu_h200_levers.sh, part qwen)
#   denoise    Wan2.2-TI2V-5B 480x832 x121: the synthetic steps of the plan whose pipeline denoise ran 11% over the
#              step model, offloaded as planned and not offloaded (is the gap the pipeline's or the step model's?)
#   pipelines  issue 14: whole pipelines planned with the profile, then generated (docs/data/h200-pipeline/gpu_h200_pipeline.sh;
#              ONLY="..." names them)
#
#   PARTS="calibrate qwen denoise pipelines" ONLY="flux-1024 wan22-5b-81" bash docs/data/h200-validate/gpu_h200_validate.sh OUT_DIR
#   QUICK=1 bash docs/data/h200-validate/gpu_h200_validate.sh OUT_DIR   # the tiny model on the CPU: a dry run of every step
set -uo pipefail
dest=${1:-${OUT:-out}}
root=${WORK:-/tmp/chunkflow-evidence}
work=$root/validate
mkdir -p "$work" "$dest"
repo=$(cd "$(dirname "$0")/../../.." && pwd)
cf=${CHUNKFLOW:-python3 -m chunkflow}
out=$work
source "$repo/scripts/run_step.sh"  # run NAME DEADLINE_S ARGS...
after_run() { tar czf "$dest/validate.tgz" --exclude='*.safetensors' -C "$root" validate; }
wanted() { [ -z "${PARTS:-}" ] || [[ " $PARTS " == *" $1 "* ]]; }
prof=$work/profile.yaml
[ -n "${PROFILE:-}" ] && cp "$PROFILE" "$prof"
if wanted cast && [ -z "${QUICK:-}" ]; then
  echo "[$(date +%T)] pytest tests/test_fp8cast.py" | tee "$work/cast-tests.log"
  (cd "$repo" && timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_fp8cast.py) 2>&1 | tee -a "$work/cast-tests.log"
  echo "[$(date +%T)] cast-tests exit ${PIPESTATUS[0]}" | tee -a "$work/cast-tests.log"
  # the kernel's launch shape, and PyTorch's copy, at calibrate's measurement (GB/s of bf16 written)
  python3 - <<'PY' 2>&1 | tee -a "$work/cast-tests.log"
import torch
import chunkflow.runtime.fp8cast as fc
from chunkflow.commands.calibrate.ops import measure_fp8_cast
dev = torch.device("cuda")
print("kernel", fc.cast_kernel_name(dev), "capability", torch.cuda.get_device_capability())
for block, warps in ((2048, 4), (4096, 4), (8192, 8), (16384, 8), (16384, 16)):
    fc.BLOCK, fc.NUM_WARPS = block, warps
    print(f"triton BLOCK={block} warps={warps}: {measure_fp8_cast(dev):.0f} GB/s")
fc.fast_cast_kernel.cache_clear(); import os; os.environ[fc.CHOICE_ENV] = "torch"
print(f"torch copy: {measure_fp8_cast(dev):.0f} GB/s ({fc.cast_kernel_name(dev)})")
PY
fi
if wanted calibrate && [ ! -f "$prof" ]; then
  if [ -n "${QUICK:-}" ]; then
    run calibrate 120 calibrate --cpu-smoke --out "$prof" --raw "$work/calibration.json" --no-save
  else
    run calibrate 330 calibrate --model wan2.2,flux,qwen-image --out "$prof" --raw "$work/calibration.json" --no-save
  fi
fi
if wanted qwen; then
  WORK=$root PROFILE=$prof PARTS=qwen bash "$repo/docs/data/h200-levers/gpu_h200_levers.sh" "$dest"
fi
if wanted pipelines; then
  WORK=$root PROFILE=$prof ONLY="${ONLY:-}" bash "$repo/docs/data/h200-pipeline/gpu_h200_pipeline.sh" "$dest"
fi
if wanted denoise; then
  if [ -n "${QUICK:-}" ]; then
    run denoise-plan 30 plan --model tiny --frames 9 --height 64 --width 64 --mem-budget 3MB --hardware "$prof" \
        --out "$work/denoise-plan.json"
    plan=$work/denoise-plan.json; dev=(--device cpu); n=(--warmup 0 --steps 2)
  else
    plan=$repo/docs/data/h200-heldout/pipeline/wan22-5b-480-121-plan.json; dev=(); n=(--warmup 1 --steps 3)
  fi
  run denoise-offload 150 run --plan "$plan" --profile "$prof" "${n[@]}" "${dev[@]}" \
      --report "$work/denoise-offload-report.json"
  run denoise-none 150 run --plan "$plan" --profile "$prof" --mode none "${n[@]}" "${dev[@]}" \
      --report "$work/denoise-none-report.json"
fi
after_run
ls -la "$dest"
