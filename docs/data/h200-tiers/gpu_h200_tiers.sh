#!/usr/bin/env bash
# Issue 36's evidence on one H200, through the product: memory tiers chosen by cost.
#   part `save5b calibrate 5b`: Wan2.2-TI2V-5B (real architecture, random values) saved with save_pretrained
#     (scripts/save_pipeline.py), `chunkflow calibrate --weights` (disk sampled as a full load reads it), then at
#     704x1280 x81, 50 steps planned, --mem-budget 12GB: `chunkflow plan` + `run --prompt` with the host unbounded
#     (1TB) and with --host-mem-budget 20GB (the tiers chosen by cost), STEPS measured steps each, cold page cache,
#     latents kept for a bit-for-bit comparison.
#   part `save14b 14b`: Wan2.1-T2V-14B at 720x1280 x81, --mem-budget 24GB --host-mem-budget 32GB (issue 29's case,
#     docs/disk-h200.md), with the profile of part 1.
#   part `saveflux flux`: FLUX.1-dev at 1024x1024 under --mem-budget 6GB --allow-fp8, the host unbounded: fp8
#     storage's host memory against the plan's.
#   part `ab`: a same-machine A/B of the hot path before (OLD_SRC) and after the tier seam (chunkflow bench).
#   PARTS="save5b calibrate 5b" bash docs/data/h200-tiers/gpu_h200_tiers.sh OUT_DIR     # call 1
#   PARTS="save14b 14b ab" bash docs/data/h200-tiers/gpu_h200_tiers.sh OUT_DIR         # call 2 (same machine or not)
set -uo pipefail
dest=${1:-${OUT:-out}}
work=${WORK:-/tmp/chunkflow-evidence}
data=${DATA:-/tmp/chunkflow-weights}
out=$work/tiers
mkdir -p "$out" "$data" "$dest"
repo=$(cd "$(dirname "$0")/../../.." && pwd)
source "$repo/scripts/run_step.sh"
cf=${CHUNKFLOW:-python3 -m chunkflow}
prompt="a cat walks on the grass"
steps=${STEPS:-8}
profile=${PROFILE:-$out/profile.yaml}
wanted() { [ -z "${PARTS:-}" ] || [[ " $PARTS " == *" $1 "* ]]; }
step() { local name=$1 deadline=$2; shift 2; echo "[$(date +%T)] $*" | tee "$out/$name.log"
  timeout "$deadline" "$@" >>"$out/$name.log" 2>&1; local rc=$?; echo "[$(date +%T)] $name exit $rc" | tee -a "$out/$name.log"; }
after_run() { tar czf "$dest/tiers.tgz" --exclude="*.safetensors" -C "$work" tiers; }
meminfo() { grep -E "^(MemAvailable|Cached|Dirty):" /proc/meminfo | tr -s ' ' | tr '\n' ' ' >> "$out/meminfo.log"; echo " $1" >> "$out/meminfo.log"; }
same() { step "$1-same" 60 python3 -c "
import sys, torch; from safetensors.torch import load_file
a, b = load_file(sys.argv[1]), load_file(sys.argv[2])
ok = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
print('latents bit-identical' if ok else 'latents DIFFER'); sys.exit(0 if ok else 1)" "$2" "$3"; }
# plan_run NAME FOLDER HOST_BUDGET SHAPE... : plan (50 steps planned), drop the folder's pages, run STEPS steps
plan_run() { local name=$1 folder=$2 host=$3 model=$4 gpu=$5; shift 5
  run $name-plan 60 plan --model $model "$@" --steps 50 --mem-budget $gpu --host-mem-budget $host \
      --hardware "$profile" --weights "$folder" --out "$out/$name-plan.json"
  step $name-drop 120 python3 "$repo/scripts/drop_cache.py" "$folder"
  meminfo "before $name"
  run $name-run 540 run --plan "$out/$name-plan.json" --weights "$folder" --prompt "$prompt" --steps $steps --seed 0 \
      --latents "$out/$name-latents.safetensors" --report "$out/$name-report.json"
  meminfo "after $name"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
if wanted check; then step check 300 python3 "$repo/docs/data/h200-tiers/check_cuda.py" "$out"; after_run; fi
if wanted save5b; then
  rm -rf "$data"/*
  step save5b 300 python3 "$repo/scripts/save_pipeline.py" wan2.2 "$data/wan22-5b"; after_run
fi
if wanted calibrate; then
  run calibrate 400 calibrate --model wan2.2 --weights "$data/wan22-5b" --out "$out/profile.yaml" \
      --raw "$out/calibration.json" --no-save
fi
if wanted 5b; then
  five=(--frames 81 --height 704 --width 1280)
  plan_run host5b "$data/wan22-5b" 1TB wan2.2 12GB "${five[@]}"
  plan_run tiers5b "$data/wan22-5b" 20GB wan2.2 12GB "${five[@]}"
  same tiers5b "$out/host5b-latents.safetensors" "$out/tiers5b-latents.safetensors"
  after_run
fi
if wanted save14b; then
  rm -rf "$data"/*
  step save14b 400 python3 "$repo/scripts/save_pipeline.py" wan2.1-14b "$data/wan21-14b"; after_run
fi
if wanted 14b; then
  STEPS14=${STEPS14:-2}
  steps=$STEPS14 plan_run disk14b "$data/wan21-14b" 32GB wan2.1-14b 24GB --frames 81 --height 720 --width 1280
  after_run
fi
if wanted saveflux; then
  rm -rf "$data"/*
  step saveflux 300 python3 "$repo/scripts/save_pipeline.py" flux "$data/flux"; after_run
fi
if wanted flux; then  # fp8 storage's host memory as held (issue 36: 26.98 GB held against 22.69 GB planned)
  steps=${STEPSFLUX:-28} plan_run fp8flux "$data/flux" 1TB flux 6GB --height 1024 --width 1024 --allow-fp8
  after_run
fi
if wanted ab; then
  old=${OLD_SRC:-$repo/.oldsrc/src}
  bench=(--model wan2.2 --frames 9,41 --height 480 --width 832 --modes none,chunkflow --warmup 1 --steps 3
         --hardware "$repo/docs/data/h200-levers/profile.yaml" --no-plots)
  for version in old head; do
    src=$([ $version = old ] && echo "$old" || echo "$repo/src")
    PYTHONPATH="${SITE:-/tmp/site}:$src" timeout 240 python3 -m chunkflow bench "${bench[@]}" --out "/tmp/ab-$version" \
      > "$out/ab-$version.log" 2>&1
    echo "ab-$version exit $?" | tee -a "$out/ab.txt"
    grep -E "frames (9|41):" "$out/ab-$version.log" | tee -a "$out/ab.txt"
  done
fi
df -h /tmp > "$out/df.txt" 2>&1; free -g >> "$out/df.txt"
after_run
echo "packed $dest/tiers.tgz"
