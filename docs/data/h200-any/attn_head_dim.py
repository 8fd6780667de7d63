"""Attention's efficiency by head dim on this GPU, with calibrate's own measurement (measure_attention_grid): the
profile's table is measured at head dim 128 (Wan, FLUX, HunyuanVideo, Qwen-Image); LTX-Video and CogVideoX run 64.

    python3 docs/data/h200-any/attn_head_dim.py OUT.json
"""

import json
import sys

import torch

from chunkflow.commands.calibrate.ops import measure_attention_grid
from chunkflow_planner.catalog import get_hardware

dev = torch.device("cuda")
peak = get_hardware("h200").peak_tflops
lens = (1024, 4096, 8192, 17776)
rows = {hd: measure_attention_grid(dev, peak, lens, heads=3072 // hd, head_dim=hd) for hd in (128, 64)}
out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "peak_tflops": peak,
       "heads_x_head_dim": 3072, "eta": {str(hd): r for hd, r in rows.items()}}
json.dump(out, open(sys.argv[1], "w"), indent=1)
for (q, kv, e128), (_, _, e64) in zip(rows[128], rows[64]):
    print(f"q {q:6.0f} kv {kv:6.0f}: eta {e128:.3f} at head dim 128, {e64:.3f} at 64 ({e64 / e128:.2f}x)")
