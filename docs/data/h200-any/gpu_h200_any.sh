#!/usr/bin/env bash
# Issues 36 and 37's evidence on one H200, through the product.
#   part `save5b tiers5b i2v5b`: Wan2.2-TI2V-5B (real architecture, random values, saved with save_pretrained):
#     - tiers5b: issue 36's case again after the disk tier's read-ahead stops at a park: 704x1280 x81, 50 steps
#       planned, --mem-budget 12GB with the host unbounded (1TB) and at --host-mem-budget 20GB (the text encoder on
#       disk), STEPS measured steps each, cold page cache, latents compared;
#     - i2v5b: image-to-video, a pipeline class the catalog never had (WanImageToVideoPipeline on the TI2V-5B
#       folder), `run --image`, against diffusers' own WanImageToVideoPipeline from the same folder (scripts/
#       diffusers_load.py: the loop's last latents, bit for bit).
#   part `saveltx ltx`, `savecog cog`: LTX-Video (2B) and CogVideoX-5B, never in the catalog, saved full size with
#     random values (scripts/save_uncatalogued.py), planned from their folders (`plan --weights DIR`, no --model)
#     with a profile calibrated before on other models (PROFILE), run with `--weights`, against diffusers.
#   PARTS="save5b tiers5b i2v5b" bash docs/data/h200-any/gpu_h200_any.sh OUT_DIR      # call 1
#   PARTS="saveltx ltx savecog cog" bash docs/data/h200-any/gpu_h200_any.sh OUT_DIR   # call 2
#   part `attn`: attention's efficiency at head dim 64 against 128 (attn_head_dim.py)
set -uo pipefail
dest=${1:-${OUT:-out}}
work=${WORK:-/tmp/chunkflow-evidence}
data=${DATA:-/tmp/chunkflow-weights}
out=$work/any
mkdir -p "$out" "$data" "$dest"
repo=$(cd "$(dirname "$0")/../../.." && pwd)
source "$repo/scripts/run_step.sh"
cf=${CHUNKFLOW:-python3 -m chunkflow}
prompt="a cat walks on the grass"
steps=${STEPS:-8}
profile=${PROFILE:-$repo/docs/data/h200-tiers/run/profile.yaml}
wanted() { [ -z "${PARTS:-}" ] || [[ " $PARTS " == *" $1 "* ]]; }
step() { local name=$1 deadline=$2; shift 2; echo "[$(date +%T)] $*" | tee "$out/$name.log"
  timeout "$deadline" "$@" >>"$out/$name.log" 2>&1; local rc=$?; echo "[$(date +%T)] $name exit $rc" | tee -a "$out/$name.log"; }
after_run() { tar czf "$dest/any.tgz" --exclude="*.safetensors" -C "$work" any; }
same() { step "$1-same" 60 python3 -c "
import sys, torch; from safetensors.torch import load_file
a, b = load_file(sys.argv[1]), load_file(sys.argv[2])
ok = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
print('latents bit-identical' if ok else 'latents DIFFER'); sys.exit(0 if ok else 1)" "$2" "$3"; }
# plan_run NAME FOLDER HOST_BUDGET GPU_BUDGET [--image PATH] -- PLAN_ARGS... : plan (50 steps), drop pages, run STEPS
plan_run() { local name=$1 folder=$2 host=$3 gpu=$4; shift 4; local image=()
  if [ "$1" = "--image" ]; then image=(--image "$2"); shift 2; fi; shift  # the --
  run $name-plan 120 plan "$@" --steps 50 --mem-budget $gpu --host-mem-budget $host \
      --hardware "$profile" --weights "$folder" --out "$out/$name-plan.json"
  step $name-drop 120 python3 "$repo/scripts/drop_cache.py" "$folder"
  run $name-run 540 run --plan "$out/$name-plan.json" --weights "$folder" --prompt "$prompt" --steps $steps --seed 0 \
      "${image[@]}" --latents "$out/$name-latents.safetensors" --report "$out/$name-report.json"; }
# reference NAME FOLDER [ARGS...]: diffusers' own pipeline from the folder, the plan's call, compared with chunkflow's
reference() { local name=$1 folder=$2; shift 2
  step $name-diffusers 400 python3 "$repo/scripts/diffusers_load.py" "$out/$name-plan.json" "$folder" --steps $steps \
      --prompt "$prompt" --seed 0 --latents "$out/$name-latents.safetensors" --out "$out/$name-diffusers.json" "$@"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
python3 -c "import torch, diffusers, transformers; print(torch.__version__, diffusers.__version__, transformers.__version__)" \
  >> "$out/gpu.txt" 2>&1
five=(--frames 81 --height 704 --width 1280)
if wanted save5b; then
  rm -rf "$data"/*
  step save5b 300 python3 "$repo/scripts/save_pipeline.py" wan2.2 "$data/wan22-5b"; after_run
fi
if wanted tiers5b; then
  plan_run host5b "$data/wan22-5b" 1TB 12GB -- --model wan2.2 "${five[@]}"
  plan_run tiers5b "$data/wan22-5b" 20GB 12GB -- --model wan2.2 "${five[@]}"
  same tiers5b "$out/host5b-latents.safetensors" "$out/tiers5b-latents.safetensors"
  after_run
fi
if wanted i2v5b; then
  python3 -c "
from PIL import Image; import numpy as np
g = np.random.default_rng(0); x = np.linspace(0, 255, 1280)[None, :, None] * np.ones((704, 1, 3))
Image.fromarray((0.7 * x + 0.3 * g.integers(0, 256, (704, 1280, 3))).astype('uint8')).save('$out/cat.png')"
  plan_run i2v5b "$data/wan22-5b" 1TB 12GB --image "$out/cat.png" -- --model wan2.2 "${five[@]}"
  reference i2v5b "$data/wan22-5b" "${five[@]}" --image "$out/cat.png"
  after_run
fi
if wanted saveltx; then
  rm -rf "$data"/*
  step saveltx 300 python3 "$repo/scripts/save_uncatalogued.py" ltx-video "$data/ltx-video"; after_run
fi
if wanted ltx; then  # LTXPipeline's defaults: 512x704, 161 frames
  plan_run ltx "$data/ltx-video" 1TB ${LTX_GPU:-20GB} --
  reference ltx "$data/ltx-video" --frames 161 --height 512 --width 704
  after_run
fi
if wanted savecog; then
  rm -rf "$data"/*
  step savecog 300 python3 "$repo/scripts/save_uncatalogued.py" cogvideox-5b "$data/cogvideox-5b"; after_run
fi
if wanted cog; then  # CogVideoX's defaults: 480x720, 49 frames
  plan_run cog "$data/cogvideox-5b" 1TB ${COG_GPU:-34GB} --
  reference cog "$data/cogvideox-5b" --frames 49 --height 480 --width 720
  after_run
fi
if wanted attn; then  # why CogVideoX steps slower than planned: attention at head dim 64 (the profile has 128's)
  step attn 120 python3 "$repo/docs/data/h200-any/attn_head_dim.py" "$out/attn-head-dim.json"; after_run
fi
df -h /tmp > "$out/df.txt" 2>&1; free -g >> "$out/df.txt"
after_run
echo "packed $dest/any.tgz"
