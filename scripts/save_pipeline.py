"""Save a catalog model's whole pipeline, in its real architectures with random values, as a diffusers folder.

    python3 scripts/save_pipeline.py wan2.2 /data/wan22-5b [--device cuda] [--max-shard-size 5GB] [--variant fp16]

The components are chunkflow's random build (each in the dtype the plan runs it in: bf16, the Wan VAE fp32, drawn on
the device for speed) and `pipe.save_pretrained(...)` writes them as diffusers and transformers do: safetensors
shards with an index, model_index.json, configs, tokenizers (chunkflow's local ones), the scheduler. What a user
downloads has the same layout; only the values differ, which no measurement of memory or time depends on.
"""

from __future__ import annotations

import argparse
import time

import torch

from chunkflow.models.pipeline_build import build_pipeline
from chunkflow_planner.catalog import get_model
from chunkflow_planner.offload import OffloadConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("folder")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--max-shard-size", default="5GB")
    ap.add_argument("--variant", default=None)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    spec = get_model(a.model)
    everything = {n: "gpu" for n in ("text_encoder", "text_encoder_2", "transformer", "transformer_2", "vae")}
    t0 = time.perf_counter()
    built = build_pipeline(spec, everything, OffloadConfig("none"), torch.device(a.device), seed=a.seed)
    t1 = time.perf_counter()
    built.pipe.save_pretrained(a.folder, max_shard_size=a.max_shard_size, variant=a.variant)
    print(f"{spec.name}: built in {t1 - t0:.1f} s, saved to {a.folder} in {time.perf_counter() - t1:.1f} s")


if __name__ == "__main__":
    main()
