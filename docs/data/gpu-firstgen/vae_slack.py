"""The allocator's slack of VAE decodes as `chunkflow calibrate` now measures it (ops.measure_vae, ops.vae_slack), on
the VAEs of the plans given (catalog models or ones derived from a folder), at calibrate's untiled sizes (random
weights): what the decode phase of a plan now prices, to set beside what round 4's runs held
(docs/data/gpu-firstgen/README.md, run 4: about 0.2 over the plans' activations for PixArt-Sigma's and SD3's decodes
at 1024x1024 on an H100).

    python3 docs/data/gpu-firstgen/vae_slack.py run-4/plan-pixart-sigma.json run-4/plan-sd3-medium.json --out vs.json
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as calibrate and run set it


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plans", nargs="+", help="plan files (their models' VAEs)")
    ap.add_argument("--out", required=True, help="JSON file of the decodes and each VAE's slack")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    import torch

    from chunkflow.commands.calibrate.ops import measure_vae, vae_points, vae_slack
    from chunkflow_planner.plan import load_plan, model_of

    device = torch.device(args.device)
    out = {"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), "vaes": {}}
    for path in args.plans:
        spec = model_of(load_plan(path))
        name = spec.name
        rows = measure_vae(spec, device, vae_points(spec, cpu=device.type != "cuda")[0], tiled=False)
        out["vaes"][spec.pipeline.vae.name] = {"model": name, "rows": rows, "alloc_slack": vae_slack(rows)}
        print(name, spec.pipeline.vae.name, "slack", vae_slack(rows),
              [(r["height"], r["peak_bytes"], r["reserved_bytes"]) for r in rows], flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
