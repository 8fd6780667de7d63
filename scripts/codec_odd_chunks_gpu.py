"""The codec at odd chunk sizes on a GPU (issue 51): its CUDA path (staging buffers, the Triton decode, each odd
chunk's first byte copied back after its decode group) against the same chunk size without the codec, bit for bit.

`python scripts/codec_odd_chunks_gpu.py OUT.json [--device cuda]`: demo-wan (real Wan architecture, random bf16
weights, saved with save_pretrained in 2 MB shards), built through the product (`build_transformer`) on the device
with `mode=chunkflow`, residency 0 and 0.5, no disk blocks and half of them on disk; per chunk size one forward
without the codec, two with it, outputs and state_dict compared exactly; the codec's stored/raw ratio recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch
from diffusers import WanTransformer3DModel

from chunkflow.models.build import build_transformer
from chunkflow.models.inputs import make_inputs
from chunkflow_planner.catalog import get_model
from chunkflow_planner.offload import OffloadConfig

MODEL, DTYPE = "demo-wan", torch.bfloat16


def forward(m, device: str) -> torch.Tensor:
    kw = make_inputs(get_model(MODEL), None, DTYPE, device, seed=1)
    with torch.no_grad():
        return m(**kw)[0].cpu()


def case(folder: Path, device: str, chunk: int, r: float, disk_half: bool) -> dict:
    build = lambda **cfg: build_transformer(MODEL, weights=folder, dtype=DTYPE, device=device,  # noqa: E731
                                            config=OffloadConfig(mode="chunkflow", chunk_bytes=chunk, residency=r,
                                                                 **cfg))
    raw, h0 = build()
    n = len(raw.blocks)
    want, state = forward(raw, device), {k: v.cpu().clone() for k, v in raw.state_dict().items()}
    h0.remove()
    del raw
    disk = n // 2 if disk_half else 0
    m, h = build(disk_blocks=disk, codec="exponent-pack")
    st = h.stats()
    outs = [torch.equal(forward(m, device), want) for _ in range(2)]
    got = m.state_dict()
    same_state = all(torch.equal(got[k].cpu(), v) for k, v in state.items())
    h.remove()
    stored = st.codec_stored_bytes + st.codec_disk_stored_bytes
    return {"chunk": chunk, "residency": r, "disk_blocks": disk, "outputs_equal": outs, "state_equal": same_state,
            "ratio": stored / max(1, st.codec_raw_bytes + st.codec_disk_raw_bytes)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["CHUNKFLOW_CACHE_DIR"] = str(Path(tmp) / "cache")
        torch.manual_seed(0)
        folder = Path(tmp) / MODEL
        WanTransformer3DModel(**get_model(MODEL).diffusers.config).eval().to(DTYPE).save_pretrained(
            folder, safe_serialization=True, max_shard_size="2MB")
        for chunk in (999, 1001, 65_537, 262_143):
            for r, half in ((0.0, False), (0.5, True)):
                rows.append(case(folder, a.device, chunk, r, half))
                print(json.dumps(rows[-1]), flush=True)
    Path(a.out).write_text(json.dumps({"device": torch.cuda.get_device_name() if a.device == "cuda" else a.device,
                                       "torch": torch.__version__, "rows": rows}, indent=1))
    ok = all(all(x["outputs_equal"]) and x["state_equal"] for x in rows)
    print(f"{sum(1 for x in rows if all(x['outputs_equal']) and x['state_equal'])} of {len(rows)} exact", flush=True)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
