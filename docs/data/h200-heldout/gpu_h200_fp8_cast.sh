#!/usr/bin/env bash
# Issue 15, where to cast fp8 weights: on the compute stream before each block (fp8_cast compute) or on the copy
# stream after its copies (fp8_cast copy), through the product: `chunkflow bench` over frames with the cast on the
# copy stream (the compute-stream sweep is crossover-fp8_e4m3 of gpu_h200_levers.sh), and `chunkflow run` of both
# at r = 0 on the levers plans (41 and 81 frames), latents kept to check both give the same bits.
#
#   PROFILE=docs/data/h200-pipeline-2/profile.yaml PLANS=docs/data/h200-levers bash docs/data/h200-heldout/gpu_h200_fp8_cast.sh OUT
#   QUICK=1 bash docs/data/h200-heldout/gpu_h200_fp8_cast.sh OUT   # the tiny model on the CPU: a dry run of every step
set -uo pipefail
dest=${1:-${OUT:-out}}
work=${WORK:-/tmp/chunkflow-evidence}
out=$work/fp8-cast
mkdir -p "$out" "$dest"
cf=${CHUNKFLOW:-python3 -m chunkflow}
repo=$(cd "$(dirname "$0")/../../.." && pwd)
source "$repo/scripts/run_step.sh"  # run NAME DEADLINE_S ARGS...
after_run() { tar czf "$dest/fp8-cast.tgz" -C "$work" --exclude='*.safetensors' fp8-cast; }
if [ -n "${QUICK:-}" ]; then
  model=tiny; size=(--height 64 --width 64); frames=(5 9); sweep=5,9,13; warmup=0; steps=2; dev=(--device cpu)
  hw=(--hardware cpu)
  for f in "${frames[@]}"; do
    run "plan-$f" 30 plan --model tiny --frames "$f" "${size[@]}" --mem-budget 2GB --transformer-only \
        --cfg-batching off "${hw[@]}" --out "$out/wan-$f-off.json"
  done
  plans=$out
else
  model=wan2.2; size=(--height 480 --width 832); frames=(41 81); sweep=9,17,25,33,41,61,81; warmup=1; steps=3; dev=()
  hw=(--hardware "${PROFILE:?PROFILE: the calibrated profile}"); plans=${PLANS:?PLANS: the levers plans folder}
fi
run crossover-fp8-copy 200 bench --model "$model" --frames "$sweep" "${size[@]}" --modes none,chunkflow \
    --weight-dtype fp8_e4m3 --fp8-cast copy --warmup "$warmup" --steps "$steps" "${hw[@]}" "${dev[@]}" --no-plots \
    --out "$out/crossover-fp8-copy"
for f in "${frames[@]}"; do
  for cast in compute copy; do
    run "wan-$f-r0-fp8-$cast" 120 run --plan "$plans/wan-$f-off.json" "${dev[@]}" --mode chunkflow --residency 0 \
        --no-cfg-batched --weight-dtype fp8_e4m3 --fp8-cast "$cast" --warmup "$warmup" --steps "$steps" \
        --report "$out/wan-$f-r0-fp8-$cast.json" --latents "$out/wan-$f-r0-fp8-$cast.safetensors"
  done
  ${PY:-python3} - "$out/wan-$f-r0-fp8-compute.safetensors" "$out/wan-$f-r0-fp8-copy.safetensors" <<'PY' | tee "$out/wan-$f-same.txt"
import sys, torch
from safetensors.torch import load_file
a, b = (load_file(p)["latents"] for p in sys.argv[1:])
print(f"cast on the compute stream vs the copy stream: bit-identical {torch.equal(a, b)}, max |diff| "
      f"{(a.float() - b.float()).abs().max().item():.3g}")
PY
done
after_run && echo "packed $dest/fp8-cast.tgz"
