#!/usr/bin/env bash
# Issue 39's evidence on one H200, through the product: streamed weights losslessly encoded (exponent-pack).
#   part `bench`: scripts/codec_bench.py (ratio, encode, decode, a block streamed encoded against raw, with and
#     without a GEMM load) and scripts/codec_kernels.py (decode kernel variants).
#   part `flux`: FLUX.1-dev (real architecture, random values, saved with save_pretrained by scripts/save_pipeline.py)
#     at 1024x1024, 8 steps, --mem-budget 6GB: `chunkflow plan --codec off` and `--codec on`, then each way in its own
#     process (scripts/codec_compare.py: a warm-up generation, then the timed one, whole): chunkflow without and with
#     the codec, diffusers' leaf-level group offloading, everything on the GPU; latents compared bit for bit.
#   part `wan`: Wan2.2-TI2V-5B at 480x832 x41, 8 steps, --mem-budget 8GB, the same four ways.
#   PARTS="bench flux" bash docs/data/h200-codec/gpu_h200_codec.sh OUT_DIR
set -uo pipefail
dest=${1:-${OUT:-out}}
work=${WORK:-/tmp/chunkflow-evidence}
data=${DATA:-/tmp/chunkflow-weights}
out=$work/codec
mkdir -p "$out" "$data" "$dest"
repo=$(cd "$(dirname "$0")/../../.." && pwd)
prompt="a cat walks on the grass"
wanted() { [ -z "${PARTS:-}" ] || [[ " $PARTS " == *" $1 "* ]]; }
step() { local name=$1 deadline=$2; shift 2; echo "[$(date +%T)] $*" | tee "$out/$name.log"
  timeout "$deadline" "$@" >>"$out/$name.log" 2>&1; local rc=$?; echo "[$(date +%T)] $name exit $rc" | tee -a "$out/$name.log"; tail -3 "$out/$name.log"; }
keep() { tar czf "$dest/codec.tgz" --exclude="*.safetensors" -C "$work" codec; cp "$out"/*.json "$dest/" 2>/dev/null; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
if wanted bench; then
  step bench 120 python3 "$repo/scripts/codec_bench.py" "$out/bench.json"
  step kernels 120 python3 "$repo/scripts/codec_kernels.py" "$out/kernels.json"
  keep
fi
# compare NAME MODEL FOLDER GPU_BUDGET SHAPE...: plans off/on, four ways
compare() { local name=$1 model=$2 folder=$3 gpu=$4; shift 4
  for c in off on; do
    step $name-plan-$c 60 python3 -m chunkflow plan --model $model "$@" --steps 8 --mem-budget $gpu --hardware h200 \
        --codec $c --weights "$folder" --out "$out/$name-plan-$c.json"
  done
  step $name-off 400 python3 "$repo/scripts/codec_compare.py" chunkflow "$out/$name-plan-off.json" "$folder" \
      --prompt "$prompt" --latents "$out/$name-off-latents.safetensors" --out "$out/$name-off.json"
  step $name-on 400 python3 "$repo/scripts/codec_compare.py" chunkflow "$out/$name-plan-on.json" "$folder" \
      --prompt "$prompt" --compare "$out/$name-off-latents.safetensors" --out "$out/$name-on.json"
  keep
  for way in ${WAYS:-leaf gpu}; do
    step $name-$way 400 python3 "$repo/scripts/codec_compare.py" $way "$out/$name-plan-off.json" "$folder" \
        --prompt "$prompt" --compare "$out/$name-off-latents.safetensors" --out "$out/$name-$way.json"
    keep
  done; }
if wanted flux; then
  [ -d "$data/flux" ] || { rm -rf "$data"/*; step saveflux 300 python3 "$repo/scripts/save_pipeline.py" flux "$data/flux"; }
  compare flux flux "$data/flux" 6GB --height 1024 --width 1024
fi
if wanted wan; then
  [ -d "$data/wan22-5b" ] || { rm -rf "$data"/*; step savewan 300 python3 "$repo/scripts/save_pipeline.py" wan2.2 "$data/wan22-5b"; }
  compare wan wan2.2 "$data/wan22-5b" 8GB --frames 41 --height 480 --width 832
fi
keep
