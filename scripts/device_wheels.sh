#!/usr/bin/env bash
# The wheels the device calls carry (.whl, ignored by git): diffusers 0.42.1 and what it, transformers and the CLI
# need for the device's Python 3.12, less what its image already holds (torch, triton, numpy, scipy, sympy, networkx,
# jinja2, fsspec, filelock) and what no device call imports (pandas). About 47 MB: with the tree, above the device's
# 64 MiB, so hold the raw folders first (scripts/device_tree.sh). Needs pip's index (this machine, not the device).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
all=$(mktemp -d)
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$all" \
  diffusers==0.42.1 transformers accelerate typer rich pydantic pyyaml ftfy safetensors tqdm 2>&1 | grep -v "^WARNING: Location" || true
rm -rf .whl && mkdir .whl
for f in "$all"/*.whl; do case $(basename "$f") in
  torch-*|nvidia_*|triton-*|numpy-*|sympy-*|mpmath-*|networkx-*|setuptools-*|filelock-*|fsspec-*|jinja2-*|markupsafe-*) ;;
  *) cp "$f" .whl/;; esac; done
rm -rf "$all"; echo "$(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl"
