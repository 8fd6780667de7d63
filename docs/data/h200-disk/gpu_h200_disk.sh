#!/usr/bin/env bash
# Issue 29's evidence on one H200, through the product: Wan2.1-T2V-14B (real architecture, random values) saved as a
# diffusers folder (scripts/save_pipeline.py), `chunkflow calibrate --weights` (the disk's cold read rate), then at
# 720x1280 x81 under --mem-budget 24GB: `chunkflow plan` + `run --prompt` with --host-mem-budget 32GB (the disk tier),
# the same with the host unbounded (1TB), and diffusers' enable_group_offload(..., offload_to_disk_path=...) on the
# same folder (scripts/diffusers_load.py --disk-offload). Cold page cache before every run (scripts/drop_cache.py).
#   PARTS="save calibrate disk" bash docs/data/h200-disk/gpu_h200_disk.sh OUT_DIR     # call 1
#   PARTS="host diffusers" bash docs/data/h200-disk/gpu_h200_disk.sh OUT_DIR          # call 2 (same machine)
set -uo pipefail
dest=${1:-${OUT:-out}}
work=${WORK:-/tmp/chunkflow-evidence}
data=${DATA:-/tmp/chunkflow-weights}
out=$work/disk
mkdir -p "$out" "$data" "$dest"
repo=$(cd "$(dirname "$0")/../../.." && pwd)
source "$repo/scripts/run_step.sh"
cf=${CHUNKFLOW:-python3 -m chunkflow}
folder=$data/wan21-14b
shape=(--frames 81 --height 720 --width 1280)
prompt="a cat walks on the grass"
steps=${STEPS:-2}
wanted() { [ -z "${PARTS:-}" ] || [[ " $PARTS " == *" $1 "* ]]; }
step() { local name=$1 deadline=$2; shift 2; echo "[$(date +%T)] $*" | tee "$out/$name.log"
  timeout "$deadline" "$@" >>"$out/$name.log" 2>&1; local rc=$?; echo "[$(date +%T)] $name exit $rc" | tee -a "$out/$name.log"; }
after_run() { tar czf "$dest/disk.tgz" --exclude="*.safetensors" -C "$work" disk; }
meminfo() { grep -E "^(MemAvailable|Cached|Dirty):" /proc/meminfo | tr -s ' ' | tr '\n' ' ' >> "$out/meminfo.log"; echo " $1" >> "$out/meminfo.log"; }
if wanted save; then
  step save 600 python3 "$repo/scripts/save_pipeline.py" wan2.1-14b "$folder"; after_run
fi
if wanted calibrate; then
  run calibrate 400 calibrate --model wan2.2 --weights "$folder" --out "$out/profile.yaml" --raw "$out/calibration.json" --no-save
fi
for kind in disk host; do
  wanted $kind || continue
  host=$([ $kind = disk ] && echo 32GB || echo 1TB)
  run $kind-plan 60 plan --model wan2.1-14b "${shape[@]}" --mem-budget 24GB --host-mem-budget $host \
      --hardware "$out/profile.yaml" --weights "$folder" --out "$out/$kind-plan.json"
  step $kind-drop 120 python3 "$repo/scripts/drop_cache.py" "$folder"
  meminfo "before $kind"
  run $kind-run 420 run --plan "$out/$kind-plan.json" --weights "$folder" --prompt "$prompt" --steps $steps --seed 0 \
      --latents "$out/$kind-latents.safetensors" --report "$out/$kind-report.json"
  meminfo "after $kind"
done
if wanted diffusers; then
  step diffusers-drop 120 python3 "$repo/scripts/drop_cache.py" "$folder"
  meminfo "before diffusers"
  step diffusers 540 python3 "$repo/scripts/diffusers_load.py" wan2.1-14b "$folder" "${shape[@]}" --steps $steps \
      --prompt "$prompt" --seed 0 --disk-offload /tmp/diffusers-offload --tiled --drop-folder-after-load \
      --latents "$out/host-latents.safetensors" --out "$out/diffusers-disk.json"
  meminfo "after diffusers"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
df -h /tmp > "$out/df.txt" 2>&1; free -g >> "$out/df.txt"
after_run
echo "packed $dest/disk.tgz"
