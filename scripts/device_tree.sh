#!/usr/bin/env bash
# The device copies the working tree with the carried wheels, 64 MiB in all; docs/data (34 MB of raw evidence) and the
# wheels (.whl, about 47 MB: diffusers, transformers and the CLI's dependencies for Python 3.12) do not fit together.
# `hold` moves the raw folders the device calls do not read (all but KEEP) to /tmp/chunkflow-held; `restore` puts them
# back (git status is clean again). Run `hold` just before a device call, `restore` right after it:
#   bash scripts/device_tree.sh hold && <device call: LIMIT=560 bash scripts/gpu_pending.sh, carry .whl>
#   bash scripts/device_tree.sh restore
set -euo pipefail
cd "$(dirname "$0")/.."
KEEP=${KEEP:-"gpu-cache gpu-firstgen gpu-formats"}
held=/tmp/chunkflow-held
case ${1:-} in
  hold)
    mkdir -p $held
    for d in docs/data/*/; do n=$(basename "$d")
      case " $KEEP " in *" $n "*) ;; *) mv "$d" "$held/$n";; esac; done
    echo "held: $(ls $held | wc -l) folders; docs/data now $(du -sh docs/data | cut -f1), .whl $(du -sh .whl 2>/dev/null | cut -f1)";;
  restore)
    [ -d $held ] || { echo "nothing held"; exit 0; }
    for d in $held/*/; do n=$(basename "$d"); [ -e "docs/data/$n" ] && { echo "docs/data/$n exists: left in $held"; continue; }
      mv "$d" "docs/data/$n"; done
    rmdir $held 2>/dev/null || true; git status --short docs/data | head -5;;
  *) echo "usage: bash scripts/device_tree.sh hold|restore"; exit 2;;
esac
