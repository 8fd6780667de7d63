"""Issue 36's tiers on CUDA: the tiny catalog pipeline saved with save_pretrained, then every component kind on the
disk tier (and two experts on different tiers) against everything on the GPU, latents compared bit for bit; the
disk components' reads and the load's bytes as tests/test_disk_components.py checks them on the CPU.

    python3 docs/data/h200-tiers/check_cuda.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

from chunkflow.generate import generate
from chunkflow.models.pipeline_build import build_pipeline
from chunkflow_planner.catalog import get_model
from chunkflow_planner.offload import OffloadConfig
from chunkflow_planner.workload import make_workload

GPU = torch.device("cuda")
STREAM = OffloadConfig("chunkflow", 4000, 0.0)
NAMES = ("text_encoder", "transformer", "transformer_2", "vae")


def two_experts(spec):
    pipe = spec.pipeline.model_copy(update={"experts": 2, "guidance_2": 3.0, "boundary_ratio": 0.5,
                                            "config": {"boundary_ratio": 0.5}})
    return spec.model_copy(update={"pipeline": pipe})


def save(spec, folder: Path) -> Path:
    built = build_pipeline(spec, {n: "gpu" for n in NAMES}, OffloadConfig("none"), torch.device("cpu"), seed=3)
    pipe = built.pipe
    built.remove()
    pipe.save_pretrained(folder)
    return folder


def run(spec, folder: Path, placements: dict[str, str]):
    built = build_pipeline(spec, placements, STREAM, GPU, weights=folder)
    gen = generate(built, make_workload(spec, steps=2), "a red fox in the snow", steps=2, seed=5)
    reads = built.disk_reads()
    load = built.load
    built.remove()
    return gen.latents.cpu(), reads, load


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    rows, ok = [], True
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec, cases in (
            ("tiny", get_model("tiny"), [
                {"text_encoder": "disk", "transformer": "gpu", "vae": "gpu"},
                {"text_encoder": "phase", "transformer": "stream", "vae": "disk"},
                {"text_encoder": "gpu", "transformer": "disk", "vae": "phase"},
                {"text_encoder": "disk", "transformer": "disk", "vae": "disk"}]),
            ("tiny-two-experts", two_experts(get_model("tiny")), [
                {"text_encoder": "phase", "transformer": "stream", "transformer_2": "disk", "vae": "phase"},
                {"text_encoder": "disk", "transformer": "disk", "transformer_2": "phase", "vae": "disk"}])):
            folder = save(spec, Path(tmp) / name)
            want, _, _ = run(spec, folder, {n: "gpu" for n in NAMES})
            for placements in cases:
                got, reads, load = run(spec, folder, placements)
                on_disk = {n for n, p in placements.items() if p == "disk"}
                same = torch.equal(got, want)
                read_ok = set(reads) == on_disk and all(reads[n] > 0 for n in on_disk)
                ok &= same and read_ok
                rows.append(dict(pipeline=name, placements=placements, bit_identical=same, disk_reads=reads,
                                 load_read_bytes=load.read_bytes, disk_component_bytes=load.disk_component_bytes))
                print(f"{name} {placements}: {'bit-identical' if same else 'DIFFERENT'}; disk reads {reads}")
    (out / "check_cuda.json").write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                                                         cases=rows), indent=1) + "\n")
    print(f"{sum(r['bit_identical'] for r in rows)} of {len(rows)} bit-identical")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
