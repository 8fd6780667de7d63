"""A full-size pipeline folder whose tensor files hold only their headers (the data a sparse hole of the right
length): what `chunkflow plan --weights DIR` reads (configs and safetensors headers, no values), so the evidence
script's plans can be checked on a machine without the disk or the time to save real values.

    python3 docs/data/gpu-firstgen/sparse_folder.py NAME FOLDER     (NAME: as scripts/save_uncatalogued.py takes)

Nothing can run from such a folder (its values are holes: zeros); it is for planning only.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))

from save_uncatalogued import build  # noqa: E402

DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def write_header_only(module: torch.nn.Module, path: Path) -> int:
    """`path` as a safetensors file of `module`'s state dict with the values left as a hole; returns its bytes."""
    header, at, seen = {}, 0, set()
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) in seen:  # a tied weight (T5's embeddings): saved once, as save_pretrained does
            continue
        seen.add(id(t))
        n = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + at)
    return 8 + len(raw) + at


def main() -> None:
    name, folder = sys.argv[1], Path(sys.argv[2])
    torch.set_default_dtype(torch.bfloat16)
    from accelerate import init_empty_weights

    with init_empty_weights():  # parameters on the meta device; buffers and the scheduler's tensors real
        pipe = build(name)
    torch.set_default_dtype(torch.float32)
    folder.mkdir(parents=True, exist_ok=True)
    pipe.save_config(folder)  # model_index.json
    total = 0
    for key, part in pipe.components.items():
        sub = folder / key
        sub.mkdir(exist_ok=True)
        if isinstance(part, torch.nn.Module):
            transformers_model = hasattr(part, "config") and hasattr(part.config, "to_json_file")
            if transformers_model:
                part.config.save_pretrained(sub)
            else:
                part.save_config(sub)
            file = "model.safetensors" if transformers_model else "diffusion_pytorch_model.safetensors"
            total += write_header_only(part, sub / file)
        elif part is not None:
            part.save_pretrained(sub)
    print(f"{name}: {total / 1e9:.2f} GB of headers and holes in {folder}")


if __name__ == "__main__":
    main()
