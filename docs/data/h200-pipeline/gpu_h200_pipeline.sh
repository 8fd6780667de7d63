#!/usr/bin/env bash
# Issue 14's evidence on one H200, through the product: `chunkflow calibrate` (GEMM and attention efficiencies by
# shape, every catalog VAE's decode), then for each whole pipeline (random weights in the real architectures)
# `chunkflow plan` under its GPU budget and `chunkflow run --prompt`, which reports every phase measured against
# the plan. docs/pipeline-h200.md is written from what it leaves.
#
#   bash docs/data/h200-pipeline/gpu_h200_pipeline.sh OUT_DIR          # one GPU; about 11 minutes on an H200
#   QUICK=1 bash docs/data/h200-pipeline/gpu_h200_pipeline.sh OUT_DIR  # the tiny pipelines on the CPU: a dry run of every step
#   PROFILE=p.yaml ONLY="wan21-14b-81 wan22-a14b-81" bash docs/data/h200-pipeline/gpu_h200_pipeline.sh OUT_DIR
#       # a calibrated profile instead of calibrating, and only the pipelines named (to split the work in parts)
#
# Every generation runs twice in its process (`--warmup 1`): the report compares the second with the plan less its
# start-up and keeps the first one's phases; `chunkflow calibrate --from-report` then measures the start-up.
# REPEAT=N measures N generations after the first (`--repeat N`: each phase's median, every time kept).
#
# Plans, reports and logs land in WORK/pipeline and are packed into OUT_DIR/pipeline.tgz after every step (so a
# run cut short still leaves what it did); the videos and images, noise with random weights, go to WORK/media and
# are only listed.
set -uo pipefail
dest=${1:-${OUT:-out}}
work=${WORK:-/tmp/chunkflow-evidence}
out=$work/pipeline
media=$work/media
mkdir -p "$out" "$media" "$dest"
pack() { ls -la "$media" > "$out/media.log"; tar czf "$dest/pipeline.tgz" -C "$work" pipeline; }
cf=${CHUNKFLOW:-python3 -m chunkflow}
repo=$(cd "$(dirname "$0")/../../.." && pwd)
source "$repo/scripts/run_step.sh"  # run NAME DEADLINE_S ARGS...
after_run() { pack; }
generate() {  # generate NAME DEADLINE_S SUFFIX PLAN_ARGS...: plan it under the profile, then generate from a prompt
  local name=$1 deadline=$2 suffix=$3; shift 3
  deadline=$(( deadline * (${REPEAT:-1} + 1) / 2 ))  # set for two generations (the warm-up and one measured)
  local prof=$out/profile.yaml
  [ -f "$prof" ] || prof=h200  # calibrate cut short: the catalog's profile (said in each plan's hardware source)
  run "$name-plan" 30 plan "$@" --hardware "$prof" --out "$out/$name-plan.json"
  [ -f "$out/$name-plan.json" ] || return
  run "$name" "$deadline" run --plan "$out/$name-plan.json" --prompt "a red fox walks through fresh snow at dawn" \
      --seed 0 --warmup 1 --repeat "${REPEAT:-1}" --out "$media/$name.$suffix" --report "$out/$name-report.json"
}
wanted() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }
[ -n "${PROFILE:-}" ] && cp "$PROFILE" "$out/profile.yaml"
if [ -n "${QUICK:-}" ]; then
  run calibrate 120 calibrate --cpu-smoke --out "$out/profile.yaml" --raw "$out/calibration.json" --no-save
  wanted tiny-wan && generate tiny-wan 120 mp4 --model tiny --mem-budget 3MB
  wanted tiny-flux && generate tiny-flux 120 png --model tiny-flux --mem-budget 3MB
else
  # the levers script (issue 15) plans with the same profile: qwen-image's curve is measured here too
  [ -f "$out/profile.yaml" ] || run calibrate 300 calibrate --model wan2.2,flux,qwen-image --out "$out/profile.yaml" \
      --raw "$out/calibration.json" --no-save
  wanted flux-1024 && generate flux-1024 150 png --model flux --batch 1 --height 1024 --width 1024 --steps 8 \
      --mem-budget 12GB
  wanted wan22-5b-81 && generate wan22-5b-81 150 mp4 --model wan2.2 --frames 81 --height 704 --width 1280 --steps 4 \
      --mem-budget 24GB
  wanted wan22-5b-121 && generate wan22-5b-121 200 mp4 --model wan2.2 --frames 121 --height 704 --width 1280 \
      --steps 4 --mem-budget 24GB
  wanted wan21-14b-81 && generate wan21-14b-81 240 mp4 --model wan2.1-14b --frames 81 --height 480 --width 832 \
      --steps 3 --mem-budget 16GB
  wanted wan22-a14b-81 && generate wan22-a14b-81 300 mp4 --model a14b --frames 81 --height 480 --width 832 \
      --steps 3 --mem-budget 24GB
  # held out: pipelines and sizes none of the above measured, to check a profile refit from their reports
  # (`chunkflow calibrate --from-report ...`, given as PROFILE)
  wanted qwen-1328 && generate qwen-1328 300 png --model qwen-image --height 1328 --width 1328 --steps 4 \
      --mem-budget 24GB
  wanted wan22-5b-480-121 && generate wan22-5b-480-121 200 mp4 --model wan2.2 --frames 121 --height 480 \
      --width 832 --steps 4 --mem-budget 16GB
  # held out of the fourth session's model: a resolution no decode was measured at, the text encoder streamed
  wanted wan22-5b-544-121 && generate wan22-5b-544-121 200 mp4 --model wan2.2 --frames 121 --height 544 \
      --width 960 --steps 4 --mem-budget 12GB
  # the issue's own question: Wan2.1-14B, 81 frames at 720p on a 24 GB card with 64 GB of host memory
  wanted wan21-14b-720-81 && generate wan21-14b-720-81 420 mp4 --model wan2.1-14b --frames 81 --height 720 \
      --width 1280 --steps 2 --mem-budget 24GB --host-mem-budget 64GB
  # a model, text encoder (Llama 3 8B and CLIP) and VAE (tiled in time and space) no generation measured before
  wanted hunyuan-544-61 && generate hunyuan-544-61 300 mp4 --model hunyuan --frames 61 --height 544 --width 960 \
      --steps 4 --mem-budget 24GB
fi
pack && cat "$out/media.log" && echo "packed $dest/pipeline.tgz"
