#!/usr/bin/env bash
# Issue 55's GPU evidence (one GPU): a process's first generation against its plan's bands, the start-up a one-sided
# term per phase (bands.with_startup) measured on this machine by `chunkflow calibrate` over three cold processes.
# Three held-out pipelines, none in chunkflow's catalog and none used to fit any of the method's terms (the start-up,
# the bands, the uncatalogued classes' activation multiple, which LTX-Video and CogVideoX set): PixArt-Sigma,
# Stable Diffusion 3 medium and Mochi-1, saved as diffusers folders (scripts/save_uncatalogued.py: the public
# checkpoints' architectures and configs, random values). Parts, in order (PARTS, default all):
#   save    the three folders
#   calib   chunkflow calibrate --startup-processes 3 --weights (the first folder: the load path) --vae-weights (the
#           others: every folder's derived VAE timed) -> profile.yaml
#   plan    each pipeline planned from its folder with that profile, before any run
#   fresh   the files a process reads (torch's and the NVIDIA libraries, the folders) dropped from the page cache,
#           as on a freshly started machine; then ROUNDS rounds, each pipeline once a round, each run its own new
#           process with no warm-up: the report judges that first generation against its first-generation bands
#   after   ROUNDS more rounds the same way, the libraries now cached (the folders dropped before each run)
# Then table.py OUT prints every report's verdicts. Raw files in $OUT (tarred as firstgen.tgz after each step).
# PREV=DIR: a previous call's firstgen.tgz unpacked in DIR (its profile, plans and reports kept, their steps done).
#   bash docs/data/gpu-firstgen/gpu_firstgen.sh OUT      (TINY=1: the tests' tiny pipelines on the CPU, a dry run;
#   SPARSE=1 PARTS="save plan": the full-size folders as headers and holes (sparse_folder.py), planned on HW=h200)
set -uo pipefail
dest=${1:-${OUT:-out}}
work=${WORK:-/tmp/firstgen-evidence}
mkdir -p "$work" "$dest"
repo=$(cd "$(dirname "$0")/../../.." && pwd)
py=${PY:-python3}
rounds=${ROUNDS:-3}
names=${NAMES:-pixart-sigma sd3-medium mochi}
source "$repo/scripts/evidence_step.sh"  # step NAME DEADLINE CMD...: done once, SKIP, keep after each
keep() { tar czf "$dest/firstgen.tgz" --exclude="folder-*" --exclude="*.done" --exclude="*.png" --exclude="*.mp4" \
  -C "$work" . ; }
wanted() { [ -z "${PARTS:-}" ] || [[ " $PARTS " == *" $1 "* ]]; }
if [ -n "${TINY:-}" ]; then dev=cpu; else dev=cuda; fi
shape() {  # each pipeline's workload, 8 steps: a size its users run (TINY: the tests' sizes, 2 steps). Mochi's
  # untiled decode (chunkflow tiles no VAE it has not measured) needs 27.85 GB at 7 frames of 480x848: its budget
  if [ -n "${TINY:-}" ]; then
    case $1 in mochi) echo "--height 32 --width 32 --frames 7 --steps 2";; *) echo "--height 32 --width 32 --steps 2";; esac
  else
    case $1 in mochi) echo "--height 480 --width 848 --frames 7 --steps 8 --mem-budget 32GB";;
      *) echo "--height 1024 --width 1024 --steps 8 --mem-budget 6GB";; esac
  fi; }
if [ -n "${PREV:-}" ]; then  # a previous call's raw files (its firstgen.tgz unpacked): a machine given back loses
  # WORK, so the profile, plans and reports come from there and their steps count as done (the folders are saved again)
  for f in "$PREV"/profile.yaml "$PREV"/calibration.json "$PREV"/calib.log "$PREV"/plan-*.json "$PREV"/plan-*.log \
      "$PREV"/report-*.json "$PREV"/run-*.log "$PREV"/drop-*.txt; do [ -f "$f" ] && cp -n "$f" "$work/"; done
  [ -f "$work/profile.yaml" ] && touch "$work/calib.done"
  for f in "$work"/plan-*.json "$work"/report-*.json; do [ -f "$f" ] || continue
    b=$(basename "$f" .json); case $b in plan-*) touch "$work/$b.done";; report-*) touch "$work/run-${b#report-}.done";; esac
  done
fi
[ -z "${TINY:-}" ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$work/gpu.txt" 2>&1
{ uptime; $py -c "import sys; print(sys.version)"; } > "$work/machine.txt" 2>&1
if wanted save; then
  shared=""
  for n in $names; do
    if [ -n "${TINY:-}" ]; then saver="$repo/docs/data/gpu-firstgen/tiny.py"; dev_arg=""
    elif [ -n "${SPARSE:-}" ]; then saver="$repo/docs/data/gpu-firstgen/sparse_folder.py"; dev_arg=""
    else saver="$repo/scripts/save_uncatalogued.py"; dev_arg="--device cuda $shared"; fi
    [ -d "$work/folder-$n" ] || step save-$n 600 $py "$saver" $n "$work/folder-$n" $dev_arg
    shared="$shared --share-with $work/folder-$n"  # the T5s are the same bytes: hard links (disk: 36 GB, not 55)
  done
fi
if wanted calib; then
  first=$(echo $names | cut -d' ' -f1); more=""
  for n in $(echo $names | cut -d' ' -f2-); do [ "$n" = "$first" ] || more="$more --vae-weights $work/folder-$n"; done
  step calib 600 $py -m chunkflow calibrate $([ -n "${TINY:-}" ] && echo --cpu-smoke || echo --model ${CAL_MODEL:-wan2.2}) \
    --startup-processes 3 --weights "$work/folder-$first" $more --out "$work/profile.yaml" --raw "$work/calibration.json" --no-save
fi
if [ -n "${TINY:-}" ]; then hw=cpu; elif [ -n "${SPARSE:-}" ]; then hw=${HW:-h200}; else hw="$work/profile.yaml"; fi
if wanted plan; then
  for n in $names; do
    step plan-$n 60 $py -m chunkflow plan --weights "$work/folder-$n" --hardware "$hw" $(shape $n) --out "$work/plan-$n.json"
  done
fi
libs() {  # the folders of the packages a run imports (found without importing them)
  $py -c "import importlib.util as u
for m in ('torch', 'nvidia', 'triton', 'diffusers', 'transformers'):
    s = u.find_spec(m)
    print(*(s.submodule_search_locations or []) if s else [], sep='\n')"; }
run_round() { local kind=$1 r=$2
  for n in $names; do
    [ -f "$work/plan-$n.json" ] || continue
    $py "$repo/scripts/drop_cache.py" "$work/folder-$n" > "$work/drop-$kind$r-$n.txt" 2>&1
    step run-$kind$r-$n 300 $py -m chunkflow run --plan "$work/plan-$n.json" --weights "$work/folder-$n" \
      --prompt "a red fox in the snow" --seed 0 --device $dev \
      --report "$work/report-$kind$r-$n.json"
  done; }
if wanted fresh; then
  for d in $(libs); do $py "$repo/scripts/drop_cache.py" "$d"; done > "$work/drop-libs.txt" 2>&1
  for r in $(seq 1 $rounds); do run_round fresh $r; done
fi
if wanted after; then
  for r in $(seq 1 $rounds); do run_round after $r; done
fi
$py "$repo/docs/data/gpu-firstgen/table.py" "$work" > "$work/table.md" 2>&1
keep
