#!/usr/bin/env bash
# Issue 35's runtime changes on one H200: (1) every case of tests/test_normal_model_3.py on cuda, bit for bit against
# no offload (check_cuda.py); (2) a same-machine A/B of the hot path before (OLD_SRC: the runtime of 4e14315, before
# the per-block version checks and slot hand-over) and after (this tree), below the critical point where per-block
# host work shows most: `chunkflow bench --model wan2.2 --frames 9,41 --height 480 --width 832 --modes none,chunkflow`,
# two rounds, versions alternating.
#   OLD_SRC=.oldsrc/src bash docs/data/h200-normal-3/gpu_h200_normal_3.sh OUT_DIR
set -uo pipefail
dest=${1:-${OUT:-out}}
mkdir -p "$dest"
repo=$(cd "$(dirname "$0")/../../.." && pwd)
site=${SITE:-/tmp/site}
old=${OLD_SRC:-$repo/.oldsrc/src}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$dest/gpu.txt"
PYTHONPATH="$site:$repo/src" timeout 500 python3 "$repo/docs/data/h200-normal-3/check_cuda.py" "$dest" 2>&1 \
  | grep -v "kept in float32" | tee "$dest/check.log"
bench=(--model wan2.2 --frames 9,41 --height 480 --width 832 --modes none,chunkflow --warmup 1 --steps 3
       --hardware "$repo/docs/data/h200-levers/profile.yaml" --no-plots)
for round in 1 2; do
  for version in old head; do
    src=$([ $version = old ] && echo "$old" || echo "$repo/src")
    PYTHONPATH="$site:$src" timeout 240 python3 -m chunkflow bench "${bench[@]}" --out "/tmp/ab-$round-$version" \
      > "$dest/ab-$round-$version.log" 2>&1
    echo "ab-$round-$version exit $?" | tee -a "$dest/ab.txt"
    grep -E "frames (9|41):" "$dest/ab-$round-$version.log" | tee -a "$dest/ab.txt"
  done
done
