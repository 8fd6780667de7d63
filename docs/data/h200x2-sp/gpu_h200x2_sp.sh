#!/usr/bin/env bash
# Issue 42's evidence on two H200s of one host (nvidia-h200-x2), through the product; not run yet (the kind was not
# lent). Per case, a plan for SP=2 (`chunkflow plan --sp 2 --hardware h200-x2 --weights DIR`), then under each link
# (p2poff: NCCL_P2P_DISABLE=1, collectives through host memory over PCIe; nvlink: the machine's default) the
# generation `torchrun --nproc-per-node 2 -m chunkflow run --plan P --weights DIR --prompt ... --warmup 1` with the
# shared host copy and without it (CHUNKFLOW_SHARE_HOST=0), host memory sampled while it runs; then diffusers' own
# context-parallel pipeline (scripts/diffusers_cp.py) on the same folder and call, latents compared bit for bit
# (scripts/compare_latents.py). The pacing goal (comm-aware pacing against layerwise's contention stall with P2P
# off) is scripts/gpu_results.py's sweep, part `pacing`. NVLink multicast is left off (NCCL_NVLS_ENABLE=0).
#   PARTS="save5b wan5b" bash docs/data/h200x2-sp/gpu_h200x2_sp.sh OUT        # call 1 (about 8 min)
#   PARTS="save14b wan14b" bash docs/data/h200x2-sp/gpu_h200x2_sp.sh OUT      # call 2
#   PARTS="pacing" bash docs/data/h200x2-sp/gpu_h200x2_sp.sh OUT              # call 3
#   DRY=1 PARTS="tiny" bash docs/data/h200x2-sp/gpu_h200x2_sp.sh OUT          # the CPU: gloo, the tiny model
set -uo pipefail
dest=${1:-${OUT:-out}}
work=${WORK:-/tmp/chunkflow-evidence}
data=${DATA:-/tmp/chunkflow-weights}
out=$work/sp2
mkdir -p "$out" "$data" "$dest"
repo=$(cd "$(dirname "$0")/../../.." && pwd)
prompt="a cat walks on the grass"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
dev=(); [ -n "${DRY:-}" ] && dev=(--device cpu)
wanted() { [ -z "${PARTS:-}" ] || [[ " $PARTS " == *" $1 "* ]]; }
step() { local name=$1 deadline=$2; shift 2; echo "[$(date +%T)] $*" | tee "$out/$name.log"
  timeout "$deadline" "$@" >>"$out/$name.log" 2>&1; local rc=$?; echo "[$(date +%T)] $name exit $rc" | tee -a "$out/$name.log"; tail -3 "$out/$name.log"; }
keep() { tar czf "$dest/sp2.tgz" --exclude="*.safetensors" --exclude="*.mp4" --exclude="*.png" -C "$work" sp2; }
sample() { while true; do echo "$(date +%s.%N) $(grep -E 'MemAvailable|Shmem:' /proc/meminfo | awk '{printf "%s ", $2}')"; sleep 0.5; done; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
nvidia-smi topo -m >> "$out/gpu.txt" 2>&1
# generate NAME PLAN FOLDER LINK SHARE: one SP=2 generation, host memory sampled
generate() { local name=$1 plan=$2 folder=$3 link=$4 share=$5
  local env=(CHUNKFLOW_SHARE_HOST=$share); [ "$link" = p2poff ] && env+=(NCCL_P2P_DISABLE=1)
  grep -E "MemAvailable|Shmem:" /proc/meminfo > "$out/meminfo-before-$name.txt"
  sample > "$out/$name-meminfo.txt" & local sampler=$!
  step $name 540 env "${env[@]}" torchrun --nproc-per-node 2 -m chunkflow run --plan "$out/$plan.json" \
      --weights "$folder" --prompt "$prompt" --seed 0 --warmup 1 "${dev[@]}" --latents "$out/$name-latents.safetensors" \
      --report "$out/$name-report.json"
  kill $sampler; keep; }
# case NAME MODEL FOLDER BUDGET SHAPE...: the plan, four generations (two links x shared or not), the reference
case_() { local name=$1 model=$2 folder=$3 budget=$4; shift 4
  local hw=(--sp 2 --hardware h200-x2); [ -n "${DRY:-}" ] && hw=(--hardware cpu)  # the CPU lists one 'GPU'
  step $name-plan 60 python3 -m chunkflow plan --model $model "$@" "${hw[@]}" --mem-budget $budget \
      --weights "$folder" --out "$out/$name-plan.json"
  for link in ${LINKS:-p2poff nvlink}; do
    generate $name-$link-shared $name-plan "$folder" $link 1
    generate $name-$link-private $name-plan "$folder" $link 0
  done
  step $name-diffusers 540 torchrun --nproc-per-node 2 "$repo/scripts/diffusers_cp.py" "$out/$name-plan.json" \
      "$folder" "$out/$name-diffusers-latents.safetensors" --prompt "$prompt" --seed 0
  step $name-compare 60 python3 "$repo/scripts/compare_latents.py" "$out/$name-diffusers-latents.safetensors" \
      "$out"/$name-*-shared-latents.safetensors "$out"/$name-*-private-latents.safetensors --out "$out/$name-latents.json"
  keep; }
if wanted tiny; then  # the CPU dry run: the tiny model's folder, gloo
  [ -d "$data/tiny" ] || step savetiny 120 python3 "$repo/scripts/save_pipeline.py" tiny "$data/tiny"
  LINKS=${LINKS:-nvlink} case_ tiny tiny "$data/tiny" 1GB
fi
if wanted save5b; then
  rm -rf "$data"/*; step save5b 300 python3 "$repo/scripts/save_pipeline.py" wan2.2 "$data/wan22-5b"; keep
fi
if wanted wan5b; then case_ wan5b wan2.2 "$data/wan22-5b" 24GB --frames 121 --height 704 --width 1280; fi
if wanted save14b; then
  rm -rf "$data"/*; step save14b 500 python3 "$repo/scripts/save_pipeline.py" wan2.1-14b "$data/wan21-14b"; keep
fi
if wanted wan14b; then case_ wan14b wan2.1-14b "$data/wan21-14b" 16GB --frames 81 --height 480 --width 832; fi
if wanted pacing; then  # layerwise's contention stall and what comm-aware pacing leaves of it, P2P off
  step pacing 560 python3 "$repo/scripts/gpu_results.py" --link p2poff --models wan --modes none,layerwise,chunkflow \
      --no-residency-sweep --no-chunk-sweep --out "$out/pacing"
  keep
fi
keep
