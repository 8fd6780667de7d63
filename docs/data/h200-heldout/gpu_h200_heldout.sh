#!/usr/bin/env bash
# Issues 14 and 15, the last check on one H200, through the product:
# 1. `chunkflow calibrate` (decodes measured at 41 and 61 frames now);
# 2. `chunkflow calibrate --from-report` over the generation reports of docs/data/h200-pipeline-2 (start-up, the
#    encode phase's host work, the postprocessing rate, the allocator's slack);
# 3. held-out pipelines planned with that profile (Qwen-Image 1328x1328 in 24 GB, never generated before; Wan2.2-5B
#    at 480x832, 121 frames in 16 GB, a size not generated before): docs/data/h200-pipeline/gpu_h200_pipeline.sh;
# 4. where to cast fp8 weights: docs/data/h200-heldout/gpu_h200_fp8_cast.sh.
#
#   bash docs/data/h200-heldout/gpu_h200_heldout.sh OUT_DIR     # one GPU; about 8 minutes on an H200
set -uo pipefail
dest=${1:-${OUT:-out}}
cal=${WORK:-/tmp/chunkflow-evidence}/calibrate
mkdir -p "$cal" "$dest"
repo=$(cd "$(dirname "$0")/../../.." && pwd)
cf=${CHUNKFLOW:-python3 -m chunkflow}
out=$cal
source "$repo/scripts/run_step.sh"
after_run() { tar czf "$dest/calibrate.tgz" -C "$cal/.." calibrate; }
run calibrate 240 calibrate --model wan2.2,flux,qwen-image --out "$cal/profile.yaml" --raw "$cal/calibration.json" \
    --no-save
reports=()
for f in "$repo"/docs/data/h200-pipeline-2/*-report.json; do reports+=(--from-report "$f"); done
run refit 60 calibrate "${reports[@]}" --profile "$cal/profile.yaml" --out "$cal/profile-refit.yaml" --no-save
unset -f after_run
WORK=${WORK:-/tmp/chunkflow-evidence}/heldout PROFILE=$cal/profile-refit.yaml ONLY="wan22-5b-480-121 qwen-1328" \
    bash "$repo/docs/data/h200-pipeline/gpu_h200_pipeline.sh" "$dest"
PROFILE=$cal/profile-refit.yaml PLANS="$repo/docs/data/h200-levers" bash "$repo/docs/data/h200-heldout/gpu_h200_fp8_cast.sh" "$dest"
