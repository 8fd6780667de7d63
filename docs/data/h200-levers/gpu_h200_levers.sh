#!/usr/bin/env bash
# Issue 15's evidence on one H200, through the product: below the critical point, batched CFG and fp8 weight
# storage against no offload, full offload and the residency the planner picked before the levers existed.
#
#   bash docs/data/h200-levers/gpu_h200_levers.sh OUT_DIR          # one GPU; about 15 minutes on an H200
#   QUICK=1 bash docs/data/h200-levers/gpu_h200_levers.sh OUT_DIR  # the tiny model on the CPU: a dry run of every step
#   PROFILE=p.yaml PARTS="41 81 crossover qwen" bash docs/data/h200-levers/gpu_h200_levers.sh OUT_DIR
#       # a calibrated profile instead of calibrating, and only the parts named (to split the work in parts)
#
# 1. `chunkflow calibrate` (the fp8 cast rate is part of the profile).
# 2. Wan2.2-TI2V-5B at 480x832, 41 and 81 frames, 2 guidance passes a step, 8 GB budget: the plan without the
#    levers (--cfg-batching off --weight-dtype bf16) and the plan with them (--allow-fp8), then `chunkflow run` of
#    no offload (unbatched and batched), chunkflow r=0, the levers-off plan's residency, batched r=0, fp8 r=0 and
#    the levers-on plan; every report has the planner's prediction next to the measurement.
# 3. The crossover: `chunkflow bench` over frames with bf16 and with fp8 storage (one pass a step, r=0).
# 4. Qwen-Image at 1328x1328 in 24 GB: planned at --max-slowdown 1.10 in bf16, with fp8 allowed and without the
#    memory margin, each plan the planner finds feasible run, with no offload for reference (and batched no offload
#    where a plan batches); with CAST_AB=1 the fp8 plan again with PyTorch's cast kernel. Not in the QUICK
#    dry run (the catalog has no tiny Qwen-Image).
# Plans, reports (with the final latents of each run, to measure batched against unbatched), bench output and logs
# are packed into OUT_DIR/levers.tgz after every step; `python3 scripts/levers_doc.py DIR` tabulates them.
set -uo pipefail
dest=${1:-${OUT:-out}}
work=${WORK:-/tmp/chunkflow-evidence}
out=$work/levers
mkdir -p "$out" "$dest"
cf=${CHUNKFLOW:-python3 -m chunkflow}
repo=$(cd "$(dirname "$0")/../../.." && pwd)
source "$repo/scripts/run_step.sh"  # run NAME DEADLINE_S ARGS...
after_run() { tar czf "$dest/levers.tgz" -C "$work" levers; }
measure() {  # measure NAME DEADLINE_S PLAN RUN_FLAGS...: one `chunkflow run` of a plan, its report kept
  local name=$1 deadline=$2 plan=$3; shift 3
  [ -f "$plan" ] || { echo "no plan $plan: $name skipped" | tee "$out/$name.log"; return; }
  run "$name" "$deadline" run --plan "$plan" --warmup "$warmup" --steps "$steps" --report "$out/$name.json" \
      --latents "$out/$name.safetensors" "$@"
}
if [ -n "${QUICK:-}" ]; then
  model=tiny; size=(--height 64 --width 64); frames=(5 9); budget=2GB; sweep=5,9,13; warmup=0; steps=2
  run calibrate 120 calibrate --cpu-smoke --out "$out/profile.yaml" --raw "$out/calibration.json" --no-save
  dev=(--device cpu)
else
  model=wan2.2; size=(--height 480 --width 832); frames=(41 81); budget=8GB; sweep=9,17,25,33,41,61,81
  warmup=1; steps=3; dev=()
  [ -n "${PROFILE:-}" ] && cp "$PROFILE" "$out/profile.yaml"
  [ -f "$out/profile.yaml" ] || run calibrate 300 calibrate --model wan2.2,qwen-image --out "$out/profile.yaml" \
      --raw "$out/calibration.json" --no-save
fi
wanted() { [ -z "${PARTS:-}" ] || [[ " $PARTS " == *" $1 "* ]]; }
hw=(--hardware "$out/profile.yaml")
[ -f "$out/profile.yaml" ] || { echo "no calibrated profile: planning with the catalog's h200" | tee "$out/profile.log"; hw=(--hardware h200); }
for f in "${frames[@]}"; do
  wanted "$f" || [ -n "${QUICK:-}" ] || continue
  run "wan-$f-plan-off" 30 plan --model "$model" --frames "$f" "${size[@]}" --mem-budget "$budget" --transformer-only \
      --cfg-batching off --weight-dtype bf16 "${hw[@]}" --out "$out/wan-$f-off.json"
  run "wan-$f-plan-on" 30 plan --model "$model" --frames "$f" "${size[@]}" --mem-budget "$budget" --transformer-only \
      --allow-fp8 "${hw[@]}" --out "$out/wan-$f-on.json"
  p=$out/wan-$f-off.json
  measure "wan-$f-none" 120 "$p" "${dev[@]}" --mode none --no-cfg-batched
  measure "wan-$f-none-batched" 120 "$p" "${dev[@]}" --mode none --cfg-batched
  measure "wan-$f-r0" 120 "$p" "${dev[@]}" --mode chunkflow --residency 0 --no-cfg-batched
  measure "wan-$f-planner-off" 120 "$p" "${dev[@]}"
  measure "wan-$f-r0-batched" 120 "$p" "${dev[@]}" --mode chunkflow --residency 0 --cfg-batched
  measure "wan-$f-r0-fp8" 120 "$p" "${dev[@]}" --mode chunkflow --residency 0 --no-cfg-batched --weight-dtype fp8_e4m3
  measure "wan-$f-planner-on" 120 "$out/wan-$f-on.json" "${dev[@]}"
done
for dt in bf16 fp8_e4m3; do
  wanted crossover || continue
  run "crossover-$dt" 240 bench --model "$model" --frames "$sweep" "${size[@]}" --modes none,chunkflow \
      --weight-dtype "$dt" --warmup "$warmup" --steps "$steps" "${hw[@]}" "${dev[@]}" --no-plots \
      --out "$out/crossover-$dt"
done
if [ -z "${QUICK:-}" ] && wanted qwen; then
  run qwen-plan-off 30 plan --model qwen-image --mem-budget 24GB --max-slowdown 1.10 --transformer-only \
      --cfg-batching off "${hw[@]}" --out "$out/qwen-off.json"
  run qwen-plan 30 plan --model qwen-image --mem-budget 24GB --max-slowdown 1.10 --transformer-only "${hw[@]}" \
      --out "$out/qwen.json"
  run qwen-plan-fp8 30 plan --model qwen-image --mem-budget 24GB --max-slowdown 1.10 --transformer-only --allow-fp8 \
      "${hw[@]}" --out "$out/qwen-fp8.json"
  # without the memory margin (planned to the byte): what the hardware allows, at the risk the margin guards against
  run qwen-plan-nomargin 30 plan --model qwen-image --mem-budget 24GB --max-slowdown 1.10 --transformer-only \
      --mem-margin 0 "${hw[@]}" --out "$out/qwen-nomargin.json"
  # the workload with no limits, for the no-offload reference whatever the plans above found
  run qwen-plan-ref 30 plan --model qwen-image --max-slowdown 1.10 --transformer-only "${hw[@]}" \
      --out "$out/qwen-ref.json"
  measure qwen-planned 180 "$out/qwen.json"
  measure qwen-planned-fp8 180 "$out/qwen-fp8.json"
  # the same fp8 plan cast by PyTorch's own copy kernel instead of the Triton one (what the cast kernel is worth)
  [ -n "${CAST_AB:-}" ] && CHUNKFLOW_FP8_CAST=torch measure qwen-planned-fp8-torchcast 180 "$out/qwen-fp8.json"
  measure qwen-planned-nomargin 180 "$out/qwen-nomargin.json"
  ref=$out/qwen-ref.json
  measure qwen-none 180 "$ref" --mode none --no-cfg-batched --weight-dtype bf16
  # batched no offload, where a plan batches (on an H200 Qwen-Image's batched forward is the slower one)
  if grep -q '"cfg_batched": true' "$out/qwen.json" "$out/qwen-fp8.json" "$out/qwen-nomargin.json" 2>/dev/null; then
    measure qwen-none-batched 180 "$ref" --mode none --cfg-batched --weight-dtype bf16
  fi
fi
after_run && echo "packed $dest/levers.tgz"
