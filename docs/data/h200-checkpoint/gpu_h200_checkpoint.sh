#!/usr/bin/env bash
# Issue 24's evidence on one H200, through the product: whole pipelines in their real architectures (random values)
# saved as diffusers folders (scripts/save_pipeline.py: save_pretrained, safetensors shards), then `chunkflow
# calibrate --weights` (the disk's cold and warm read rates, page-locking, new memory), `chunkflow plan --weights`
# and `chunkflow run --weights --prompt` with a cold page cache and a warm one; diffusers' own from_pretrained +
# .to("cuda") of the same folder for comparison (time, host peak, latents); and the synthetic denoising steps of the
# plan with the loaded transformer and with random weights (is a slower denoise the machine's or the load's?).
#
#   PARTS="calibrate wan22-5b" bash docs/data/h200-checkpoint/gpu_h200_checkpoint.sh OUT_DIR      # call 1
#   PROFILE=p.yaml PARTS="wan21-14b" bash docs/data/h200-checkpoint/gpu_h200_checkpoint.sh OUT_DIR  # call 2 (64 GB of disk: one
#                                                                                # 40 GB pipeline at a time)
#   QUICK=1 bash docs/data/h200-checkpoint/gpu_h200_checkpoint.sh OUT_DIR   # the tiny pipeline on the CPU: a dry run of every step
#   STATES=warm LOADS_ONLY=1 ...   # only the warm run, without the steps and diffusers comparisons (a re-measure)
#
# Plans, reports and logs land in WORK/checkpoint and are packed into OUT_DIR/checkpoint.tgz after every step; each
# pipeline folder (DATA/NAME) is removed once its part is done.
set -uo pipefail
dest=${1:-${OUT:-out}}
work=${WORK:-/tmp/chunkflow-evidence}
data=${DATA:-/tmp/chunkflow-weights}
out=$work/checkpoint
mkdir -p "$out" "$dest" "$data"
repo=$(cd "$(dirname "$0")/../../.." && pwd)
cf=${CHUNKFLOW:-python3 -m chunkflow}
source "$repo/scripts/run_step.sh"  # run NAME DEADLINE_S ARGS...
after_run() { tar czf "$dest/checkpoint.tgz" --exclude='*.safetensors' -C "$work" checkpoint; }
wanted() { [ -z "${PARTS:-}" ] || [[ " $PARTS " == *" $1 "* ]]; }
prof=$out/profile.yaml
[ -n "${PROFILE:-}" ] && cp "$PROFILE" "$prof"
prompt="a cat walks on the grass"
negative="blurry, low quality"

step() {  # step NAME DEADLINE_S COMMAND...: a non-product command, logged like `run`
  local name=$1 deadline=$2; shift 2
  echo "[$(date +%T)] $*" | tee "$out/$name.log"
  timeout "$deadline" "$@" 2>&1 | tee -a "$out/$name.log"
  echo "[$(date +%T)] $name exit ${PIPESTATUS[0]}" | tee -a "$out/$name.log"
  after_run
}

pipeline() {  # pipeline NAME MODEL DEADLINE_S PLAN_ARGS...
  local name=$1 model=$2 deadline=$3; shift 3
  local folder=$data/$name dev=() ref=1
  [ -n "${QUICK:-}" ] && dev=(--device cpu) && ref=
  step "$name-save" 600 python3 "$repo/scripts/save_pipeline.py" "$model" "$folder"
  du -sh "$folder"/* > "$out/$name-folder.log" 2>&1
  if [ ! -f "$prof" ]; then
    if [ -n "${QUICK:-}" ]; then
      run calibrate 180 calibrate --cpu-smoke --weights "$folder" --out "$prof" --raw "$out/calibration.json" --no-save
    else
      run calibrate 360 calibrate --model wan2.2 --weights "$folder" --out "$prof" --raw "$out/calibration.json" \
          --no-save
    fi
  fi
  local hw=$prof; [ -f "$prof" ] || hw=h200
  run "$name-plan" 60 plan --model "$model" "$@" --hardware "$hw" --weights "$folder" --out "$out/$name-plan.json"
  [ -f "$out/$name-plan.json" ] || return
  for state in ${STATES:-cold warm}; do
    if [ "$state" = cold ]; then
      step "$name-drop" 60 python3 "$repo/scripts/drop_cache.py" "$folder"
    else
      find -L "$folder" -type f -exec cat {} + > /dev/null  # every file in the page cache: a warm load
    fi
    run "$name-$state" "$deadline" run --plan "$out/$name-plan.json" --weights "$folder" --prompt "$prompt" \
        --negative-prompt "$negative" --guidance 5 --seed 0 --warmup 1 "${dev[@]}" \
        --latents "$out/$name-$state-latents.safetensors" --report "$out/$name-$state-report.json"
  done
  [ -n "${LOADS_ONLY:-}" ] && { rm -rf "$folder"; return; }
  # the denoising steps alone, the loaded transformer against random weights in the same place: the same copies
  run "$name-steps-loaded" 240 run --plan "$out/$name-plan.json" --weights "$folder/transformer" --steps 3 "${dev[@]}" \
      --report "$out/$name-steps-loaded.json"
  run "$name-steps-random" 240 run --plan "$out/$name-plan.json" --steps 3 "${dev[@]}" \
      --report "$out/$name-steps-random.json"
  if [ -n "$ref" ]; then
    step "$name-diffusers-drop" 60 python3 "$repo/scripts/drop_cache.py" "$folder"
    local shape; shape=$(python3 -c "import json,sys; w=json.load(open(sys.argv[1]))['workload']; \
print(f\"--frames {w['frames']} --height {w['height']} --width {w['width']} --steps {w['steps']} --batch {w['batch']}\")" \
        "$out/$name-plan.json")
    # shellcheck disable=SC2086
    step "$name-diffusers" "$deadline" python3 "$repo/scripts/diffusers_load.py" "$model" "$folder" $shape --prompt "$prompt" \
        --negative-prompt "$negative" --guidance 5 --seed 0 --latents "$out/$name-cold-latents.safetensors" \
        --out "$out/$name-diffusers.json"
  fi
  rm -rf "$folder"
}

if [ -n "${QUICK:-}" ]; then
  pipeline tiny tiny 120 --mem-budget 3MB
else
  wanted wan22-5b && pipeline wan22-5b wan2.2 300 --frames 41 --height 480 --width 832 --steps 4 --mem-budget 8GB
  wanted wan21-14b && pipeline wan21-14b wan2.1-14b 420 --frames 81 --height 480 --width 832 --steps 4 \
      --mem-budget 16GB
fi
after_run
ls -la "$dest"
