"""Compare latents files (`chunkflow run --latents`) bit for bit: `python scripts/compare_latents.py A B [C...] --out
result.json` writes, for each file after the first, whether every tensor equals the first file's and the largest
absolute difference."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from safetensors.torch import load_file


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out")
    a = ap.parse_args()
    ref = load_file(a.files[0])
    res = {"reference": a.files[0], "compared": []}
    for f in a.files[1:]:
        if not Path(f).exists():
            res["compared"].append({"file": f, "missing": True})
            continue
        got = load_file(f)
        same = set(got) == set(ref) and all(got[k].shape == ref[k].shape and bool((got[k] == ref[k]).all())
                                            for k in ref)
        diff = max(((got[k].float() - ref[k].float()).abs().max().item() for k in ref
                    if k in got and got[k].shape == ref[k].shape), default=None)
        res["compared"].append({"file": f, "bit_identical": same, "max_abs_diff": diff})
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
