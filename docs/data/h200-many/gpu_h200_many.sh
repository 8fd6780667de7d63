#!/usr/bin/env bash
# Issue 38's evidence on one H200, through the product: Wan2.2-TI2V-5B (real architecture, random values, saved with
# save_pretrained), planned at 832x480 x49 frames, 8 steps, --mem-budget 12GB --host-mem-budget 40GB, with the profile
# calibrated on this H200 before (docs/data/h200-tiers/run/profile.yaml). The ten jobs of jobs.jsonl (ten prompts,
# seeds 0-9):
#   part `save`:    the pipeline folder (scripts/save_pipeline.py);
#   part `jobs`:    `chunkflow run --prompts jobs.jsonl --out-dir` (one load, ten jobs), the page cache dropped first;
#   part `serve`:   `chunkflow serve` and scripts/serve_client.py submitting the ten jobs at once over HTTP, each job's
#                   predicted finish (the server's, at submission) against its measured finish, the server's host
#                   memory after each job;
#   part `singles`: the same ten jobs as ten `chunkflow run --prompt` processes, one after another (what a user paid
#                   before), the page cache dropped before the first only.
#   PARTS="save jobs serve" bash docs/data/h200-many/gpu_h200_many.sh OUT_DIR     # call 1
#   PARTS="singles" SEEDS="0 1 2 3 4" bash docs/data/h200-many/gpu_h200_many.sh OUT_DIR   # calls 2 and 3 (the same
#   PARTS="singles" SEEDS="5 6 7 8 9" bash docs/data/h200-many/gpu_h200_many.sh OUT_DIR   # machine, warm)
set -uo pipefail
dest=${1:-${OUT:-out}}
work=${WORK:-/tmp/chunkflow-evidence}
data=${DATA:-/tmp/chunkflow-weights}
out=$work/many
mkdir -p "$out" "$data" "$dest"
repo=$(cd "$(dirname "$0")/../../.." && pwd)
here=$repo/docs/data/h200-many
source "$repo/scripts/run_step.sh"
cf=${CHUNKFLOW:-python3 -m chunkflow}
profile=${PROFILE:-$repo/docs/data/h200-tiers/run/profile.yaml}
folder=$data/wan22-5b
plan=$out/plan.json
wanted() { [ -z "${PARTS:-}" ] || [[ " $PARTS " == *" $1 "* ]]; }
step() { local name=$1 deadline=$2; shift 2; echo "[$(date +%T)] $*" | tee "$out/$name.log"
  timeout "$deadline" "$@" >>"$out/$name.log" 2>&1; local rc=$?; echo "[$(date +%T)] $name exit $rc" | tee -a "$out/$name.log"; }
after_run() { tar czf "$dest/many.tgz" --exclude="*.safetensors" --exclude="*.mp4" -C "$work" many; }
now() { date +%s.%N; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
python3 -c "import torch, diffusers, transformers; print(torch.__version__, diffusers.__version__, transformers.__version__)" \
  >> "$out/gpu.txt" 2>&1
if wanted save; then
  [ -f "$folder/model_index.json" ] || step save 300 python3 "$repo/scripts/save_pipeline.py" wan2.2 "$folder"
  run plan 120 plan --model wan2.2 --frames 49 --height 480 --width 832 --steps 8 --mem-budget 12GB \
      --host-mem-budget 40GB --hardware "$profile" --weights "$folder" --out "$plan"
fi
if wanted jobs; then
  step jobs-drop 120 python3 "$repo/scripts/drop_cache.py" "$folder"
  t0=$(now)
  run jobs 580 run --plan "$plan" --weights "$folder" --prompts "$here/jobs.jsonl" --out-dir "$out/jobs-out" \
      --report "$out/jobs-report.json"
  echo "jobs wall_s $(python3 -c "print(round($(now) - $t0, 2))")" | tee "$out/jobs-wall.txt"
fi
if wanted serve; then
  step serve-drop 120 python3 "$repo/scripts/drop_cache.py" "$folder"
  t0=$(now)
  $cf serve --plan "$plan" --weights "$folder" --port 8765 --out-dir "$out/serve-out" > "$out/serve.log" 2>&1 &
  pid=$!
  step serve-client 560 python3 "$repo/scripts/serve_client.py" http://127.0.0.1:8765 "$here/jobs.jsonl" \
      --pid $pid --fetch "$out/serve-fetched" --out "$out/serve-client.json"
  kill -INT $pid; wait $pid; echo "serve exit $? wall_s $(python3 -c "print(round($(now) - $t0, 2))")" >> "$out/serve.log"
  after_run
fi
if wanted singles; then
  [ -s "$out/singles.tsv" ] || step singles-drop 120 python3 "$repo/scripts/drop_cache.py" "$folder"
  mkdir -p "$out/singles-out"
  t0=$(now)
  python3 -c "import json,sys; [print(json.loads(l)['seed'], json.loads(l)['prompt'], sep='\t') for l in open(sys.argv[1])]" \
      "$here/jobs.jsonl" | while IFS=$'\t' read -r seed prompt; do
    [[ " ${SEEDS:-0 1 2 3 4 5 6 7 8 9} " == *" $seed "* ]] || continue
    t=$(now)
    run single-$seed 300 run --plan "$plan" --weights "$folder" --prompt "$prompt" --seed $seed \
        --out "$out/singles-out/single-$seed.mp4" --report "$out/single-$seed.json" < /dev/null
    echo -e "$seed\t$(python3 -c "print(round($(now) - $t, 2))")" >> "$out/singles.tsv"
  done
  echo "singles ${SEEDS:-all} wall_s $(python3 -c "print(round($(now) - $t0, 2))")" | tee -a "$out/singles-wall.txt"
fi
# the outputs compared file for file (H.264 of the same frames is the same file)
python3 - "$out" > "$out/compare.txt" 2>&1 <<'PY'
import hashlib, json, sys
from pathlib import Path
out = Path(sys.argv[1])
h = lambda p: hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
jobs = sorted((out / "jobs-out").glob("*.mp4")) if (out / "jobs-out").is_dir() else []
served = {p.stem: p for p in (out / "serve-fetched").glob("*.mp4")} if (out / "serve-fetched").is_dir() else {}
client = json.loads((out / "serve-client.json").read_text()) if (out / "serve-client.json").is_file() else {"jobs": []}
by_seed = {j["seed"]: served.get(j["id"]) for j in client["jobs"]}
for p in jobs:
    seed = int(p.name[:4]) - 1
    single = out / "singles-out" / f"single-{seed}.mp4"
    print(p.name, "single:", h(p) == h(single) if single.is_file() else "absent",
          "served:", h(p) == h(by_seed[seed]) if by_seed.get(seed) else "absent")
PY
after_run
