#!/usr/bin/env bash
# Issue 40's one-GPU evidence on one H200, through the product: one host copy shared by the local ranks of a host.
#   part `bench`: scripts/shared_host_bench.py: two processes (LOCAL_RANK 0/1, LOCAL_WORLD_SIZE 2) on cuda:0 streaming
#     FLUX.1-dev's transformer (r=0: every block from host memory) from one shared segment, then from private stores;
#     offload time, pinned bytes, host memory (Pss, used, Shmem), forward time alone and together, a raw 16 MB-chunk
#     copy rate from the shared pages against a private pinned store, clean-up (Shmem, /dev/shm, holders) after a
#     normal exit and after the owner is killed.
#   part `flux`: FLUX.1-dev (real architecture, random values, saved with save_pretrained) 1024x1024, 8 steps,
#     --mem-budget 6GB: `chunkflow run --plan --prompt` alone (SP=1: unchanged from before the shared tier), then
#     the same command as two processes of one host sharing (LOCAL_WORLD_SIZE 2, both on the one GPU): host memory
#     sampled while they run, each one's report, latents of all three compared bit for bit.
#   PARTS="bench flux" bash docs/data/h200-shared/gpu_h200_shared.sh OUT_DIR
set -uo pipefail
dest=${1:-${OUT:-out}}
work=${WORK:-/tmp/chunkflow-evidence}
data=${DATA:-/tmp/chunkflow-weights}
out=$work/shared
mkdir -p "$out" "$data" "$dest"
repo=$(cd "$(dirname "$0")/../../.." && pwd)
prompt="a cat walks on the grass"
wanted() { [ -z "${PARTS:-}" ] || [[ " $PARTS " == *" $1 "* ]]; }
step() { local name=$1 deadline=$2; shift 2; echo "[$(date +%T)] $*" | tee "$out/$name.log"
  timeout "$deadline" "$@" >>"$out/$name.log" 2>&1; local rc=$?; echo "[$(date +%T)] $name exit $rc" | tee -a "$out/$name.log"; tail -3 "$out/$name.log"; }
keep() { tar czf "$dest/shared.tgz" --exclude="*.safetensors" --exclude="*.png" -C "$work" shared; }  # one file back
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
grep -E "MemTotal|MemAvailable|Shmem:" /proc/meminfo > "$out/meminfo-start.txt"
if wanted probe; then
  step probe 120 python3 "$repo/scripts/shm_fill_probe.py" "$out/probe.json" 8
  keep
fi
if wanted bench; then
  step bench 420 python3 "$repo/scripts/shared_host_bench.py" "$out/bench.json" --model flux --height 512 --width 512
  keep
fi
sample() { while true; do echo "$(date +%s.%N) $(grep -E 'MemAvailable|Shmem:' /proc/meminfo | awk '{printf "%s ", $2}')"; sleep 0.5; done; }
# two NAME PLAN: the plan run as two processes of one host sharing (LOCAL_WORLD_SIZE 2, both on the one GPU, each its
# own generation), host memory sampled while they run; SHARE=0 before it: the same with one copy per process
two() { local name=$1 plan=$2
  grep -E "MemAvailable|Shmem:" /proc/meminfo > "$out/meminfo-before-$name.txt"
  sample > "$out/$name-meminfo.txt" & local sampler=$!
  echo "[$(date +%T)] $name: two processes sharing" | tee "$out/$name.log"
  # both ranks are children of one shell, as torchrun's agent starts them: the shared copy serves only a sibling of
  # its owner (one `timeout` per rank would give each its own parent, and the owner would rightly refuse the other)
  NAME=$name PLAN="$out/$plan.json" OUTD="$out" DATA="$data" PROMPT="$prompt" SHARE=${SHARE:-1} timeout 560 bash -c '
    for r in 0 1; do
      LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 TORCHELASTIC_RUN_ID=$NAME-$$ CHUNKFLOW_SHARE_HOST=$SHARE python3 -m chunkflow run \
          --plan "$PLAN" --weights "$DATA/flux" --prompt "$PROMPT" --warmup 1 --out "$OUTD/flux-$NAME-$r.png" \
          --latents "$OUTD/flux-$NAME-$r-latents.safetensors" --report "$OUTD/flux-$NAME-$r-report.json" \
          > "$OUTD/$NAME-$r.log" 2>&1 &
      pids[$r]=$!
    done
    for r in 0 1; do wait ${pids[$r]}; echo "rank $r exit $?"; done' | tee -a "$out/$name.log"
  kill $sampler
  sleep 1; grep -E "MemAvailable|Shmem:" /proc/meminfo > "$out/meminfo-after-$name.txt"
  ls /dev/shm > "$out/dev-shm-after-$name.txt" 2>&1
  keep; }
if wanted two; then  # the two-process runs alone (part flux made the reference latents)
  [ -d "$data/flux" ] || step saveflux 300 python3 "$repo/scripts/save_pipeline.py" flux "$data/flux"
  for c in on off; do
    step flux-plan-$c 60 python3 -m chunkflow plan --model flux --height 1024 --width 1024 --steps 8 --mem-budget 6GB \
        --hardware h200 --weights "$data/flux" --codec $c --out "$out/flux-plan-$c.json"
  done
  two two-on flux-plan-on
  SHARE=0 two two-on-private flux-plan-on
  two two-off flux-plan-off
fi
if wanted trust; then  # issue 51's rerun: hardened shared copy (codec on), two ranks against one process alone
  [ -d "$data/flux" ] || step saveflux 300 python3 "$repo/scripts/save_pipeline.py" flux "$data/flux"
  step flux-plan-on 60 python3 -m chunkflow plan --model flux --height 1024 --width 1024 --steps 8 --mem-budget 6GB \
      --hardware h200 --weights "$data/flux" --codec on --out "$out/flux-plan-on.json"
  two two-on flux-plan-on
  step flux-sp1 400 python3 -m chunkflow run --plan "$out/flux-plan-on.json" --weights "$data/flux" --prompt "$prompt" \
      --warmup 1 --out "$out/flux-sp1.png" --latents "$out/flux-sp1-latents.safetensors" --report "$out/flux-sp1-report.json"
  step compare 60 python3 "$repo/scripts/compare_latents.py" "$out/flux-sp1-latents.safetensors" \
      "$out"/flux-two-on-*-latents.safetensors --out "$out/latents.json"
  keep
fi
if wanted flux; then
  [ -d "$data/flux" ] || step saveflux 300 python3 "$repo/scripts/save_pipeline.py" flux "$data/flux"
  step flux-plan 60 python3 -m chunkflow plan --model flux --height 1024 --width 1024 --steps 8 --mem-budget 6GB \
      --hardware h200 --weights "$data/flux" --out "$out/flux-plan.json"
  step flux-sp1 400 python3 -m chunkflow run --plan "$out/flux-plan.json" --weights "$data/flux" --prompt "$prompt" \
      --warmup 1 --out "$out/flux-sp1.png" --latents "$out/flux-sp1-latents.safetensors" --report "$out/flux-sp1-report.json"
  keep
  step flux-plan-off 60 python3 -m chunkflow plan --model flux --height 1024 --width 1024 --steps 8 --mem-budget 6GB \
      --hardware h200 --weights "$data/flux" --codec off --out "$out/flux-plan-off.json"
  two two flux-plan
  two two-off flux-plan-off
  step compare 60 python3 "$repo/scripts/compare_latents.py" "$out/flux-sp1-latents.safetensors" \
      "$out"/flux-two-*-latents.safetensors --out "$out/latents.json"
  keep
fi
keep
