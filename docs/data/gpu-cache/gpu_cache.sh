#!/usr/bin/env bash
# Issue 54's GPU evidence (one GPU): FLUX.1-dev 1024x1024 28 steps at 6 GB and Wan2.2-TI2V-5B 704x1280 x81 at 8 GB,
# pipelines saved as diffusers folders (real architectures, random values: scripts/save_pipeline.py), each way its
# own process with one warm-up generation: chunkflow at the plan's setting with no cache, first-block caching and
# MagCache (the plan made with the same --cache first, its prediction in the plan file), against diffusers' group
# offloading (block level, streams) with the same cache config, and the same cache all on the GPU (diffusers alone)
# for the latents, which must be bit-identical to chunkflow's; first-block caching also at the no-cache plan's setting
# (block 0 streamed). `first-block:auto`: the threshold probe.py finds nearest the planner's prior hit rate on these
# random weights (FBC_THRESHOLD=T gives it; THRESHOLDS=record: one generation's measures, probe.py). Where the part's budget does not fit (Wan2.2-5B's tiled decode at 704x1280
# x81 needs more than 8 GB on both profiles), the budget goes up by 1 GB until the no-cache plan fits (budget-PART.txt
# says which), and every way of the part is planned at it. WARMUP=N: whole generations before the measured one (default
# 1; 0 measures the process's first, as the plan predicts it). Raw files in $OUT (tarred as cache.tgz).
#   PARTS="flux wan" bash docs/data/gpu-cache/gpu_cache.sh OUT_DIR       (TINY=1: the tiny catalog pipelines, CPU)
set -uo pipefail
dest=${1:-${OUT:-out}}
work=${WORK:-/tmp/cache-evidence}
mkdir -p "$work" "$dest"
repo=$(cd "$(dirname "$0")/../../.." && pwd)
py=${PY:-python3}
dev=$([ -n "${TINY:-}" ] && echo cpu || echo cuda)
source "$repo/scripts/evidence_step.sh"  # step NAME DEADLINE CMD...: done once, SKIP, keep after each
keep() { tar czf "$dest/cache.tgz" --exclude="*.safetensors" --exclude="*.pt" --exclude="folder-*" --exclude="*.done" \
  -C "$work" . ; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$work/gpu.txt" 2>&1
for part in ${PARTS:-flux wan}; do
  if [ -n "${TINY:-}" ]; then
    model=$([ $part = flux ] && echo tiny-flux || echo tiny); shape=""; budget=8GB; hw=cpu; steps=6
  elif [ $part = flux ]; then
    model=flux; shape="--height 1024 --width 1024"; budget=6GB; hw=${HW:-h200}; steps=28
  else
    model=wan2.2; shape="--height 704 --width 1280 --frames 81"; budget=8GB; hw=${HW:-h200}; steps=50
  fi
  folder=$work/folder-$part
  if [ -z "${TINY:-}" ] && [ ! -f "$work/budget-$part.txt" ]; then  # the smallest whole-GB budget the plan admits
    for extra in 0 1 2 3 4; do b=$(( ${budget%GB} + extra ))GB
      $py -m chunkflow plan --model $model $shape --steps $steps --hardware $hw --mem-budget $b > /dev/null 2>&1 && break
    done
    echo "$b (asked ${budget}: the smallest whole-GB budget whose no-cache plan is feasible on $hw)" > "$work/budget-$part.txt"
  fi
  [ -f "$work/budget-$part.txt" ] && budget=$(cut -d' ' -f1 "$work/budget-$part.txt")
  [ -d "$folder" ] || step save-$part 900 $py "$repo/scripts/save_pipeline.py" $model "$folder" --device $dev
  for cache in ${CACHES:-none first-block:auto mag:ratios=flux}; do
    if [ "$cache" = first-block:auto ]; then  # the threshold nearest the prior's hit rate on these random weights
      [ -f "$work/plan-$part-none.json" ] || step plan-$part-none 60 $py -m chunkflow plan --model $model $shape \
        --steps $steps --hardware $hw --mem-budget $budget --out "$work/plan-$part-none.json"  # the probe's setting
      [ -f "$work/probe-$part.json" ] || step probe-$part 600 $py "$repo/docs/data/gpu-cache/probe.py" \
        "$work/plan-$part-none.json" "$folder" --device $dev --out "$work/probe-$part.json" \
        --thresholds ${THRESHOLDS:-0.3,0.45,0.6,0.8}
      [ -f "$work/probe-$part.json" ] && read -r threshold rate < <($py -c "import json,sys; p=json.load(open(sys.argv[1])); \
print(p['chosen'], p['hit_rate'])" "$work/probe-$part.json")  # none where SKIP left the probe out (FBC_THRESHOLD)
      cache=first-block:${FBC_THRESHOLD:-$threshold}; rate=${FBC_HIT_RATE:-$rate}
    fi
    tag=$part-${cache%%:*}
    with=$([ "$cache" = none ] && echo "" || echo "--cache $cache")
    rated=$([ "${cache%%:*}" = first-block ] && [ -n "${rate:-}" ] && echo "--cache-hit-rate $rate" || echo "")
    step plan-$tag 60 $py -m chunkflow plan --model $model $shape --steps $steps --hardware $hw --mem-budget $budget \
      $with $rated --out "$work/plan-$tag.json"
    step run-$tag 900 $py -m chunkflow run --plan "$work/plan-$tag.json" --weights "$folder" --prompt "a red fox in the snow" \
      --seed 0 --warmup ${WARMUP:-1} --device $dev --latents "$work/latents-$tag.safetensors" --report "$work/report-$tag.json"
    if [ "${cache%%:*}" = first-block ] && [ -f "$work/plan-$part-none.json" ]; then  # block 0 streamed, as planned
      # without the cache (the first-block plan keeps it whole where that is faster: whole_first.py)
      step run-$tag-streamed 900 $py -m chunkflow run --plan "$work/plan-$part-none.json" --weights "$folder" \
        --prompt "a red fox in the snow" --seed 0 --warmup ${WARMUP:-1} --device $dev $with \
        --latents "$work/latents-$tag-streamed.safetensors" --report "$work/report-$tag-streamed.json"
      same=1
    fi
    # diffusers all on the GPU, then group-offloaded, each against chunkflow's latents where this machine made them
    lat() { [ -f "$work/latents-$tag.safetensors" ] && echo "--latents $work/latents-$tag.safetensors"; }
    step gpu-$tag 900 $py "$repo/scripts/diffusers_load.py" "$work/plan-$tag.json" "$folder" --steps $steps \
      --prompt "a red fox in the snow" --seed 0 --warmup ${WARMUP:-1} --device $dev $with $(lat) \
      --out "$work/diffusers-gpu-$tag.json"
    step group-$tag 900 $py "$repo/scripts/diffusers_load.py" "$work/plan-$tag.json" "$folder" --steps $steps \
      --prompt "a red fox in the snow" --seed 0 --warmup ${WARMUP:-1} --device $dev $with --group-offload $(lat) \
      --out "$work/diffusers-group-$tag.json"
    if [ -n "${same:-}" ] && [ -f "$work/latents-$tag-streamed.safetensors" ]; then  # the two settings' latents,
      # bit for bit (the same kernels on the same weights); none where the streamed run was skipped
      $py -c "import json,sys,torch; from safetensors.torch import load_file as f; a,b=f(sys.argv[1]),f(sys.argv[2]); \
json.dump({'identical': a.keys()==b.keys() and all(torch.equal(a[k],b[k]) for k in a)}, open(sys.argv[3],'w'))" \
        "$work/latents-$tag.safetensors" "$work/latents-$tag-streamed.safetensors" "$work/compare-$tag-streamed.json"
    fi
    unset same
    keep
  done
done
keep
