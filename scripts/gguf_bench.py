"""Issue 52's GPU evidence: a GGUF transformer streamed as stored, against the same file all on the GPU and
diffusers' leaf-level group offloading of it, each way its own process.

    python3 scripts/gguf_bench.py write DIR --qtype q8_0 [--tiny]       # DIR/transformer/config.json + DIR/q8_0.gguf
    python3 scripts/gguf_bench.py time DIR --qtype q8_0 --way gpu|chunkflow|leaf OUT.json [--mem-budget 6GB]
    python3 scripts/gguf_bench.py decode OUT.json                       # dequantization rate per type, GB/s of bf16

The file: FLUX.1-dev's transformer (real architecture; `--tiny` a two-block one for a CPU dry run) in diffusers'
key names (diffusers' from_single_file takes them as they are), every 2-D weight whose rows fit the type's blocks in
that type, random quant blocks with finite fp16 scales (random values: no time depends on them), the rest F32, as
city96's files keep 1-D tensors. The module is diffusers' own (`from_single_file` + GGUFQuantizationConfig, bf16
compute); a transformer forward at 1024x1024 (4096 image and 512 text tokens), one warm-up and `--repeat` timed. The
chunkflow way takes the setting `chunkflow plan --format QTYPE --transformer-only --mem-budget` chooses on this
GPU's catalog profile, and writes the plan's predicted step time beside the measured one. Every way saves its output
(DIR/out-WAY-QTYPE.pt); `compare` checks them bit for bit.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                axes_dims_rope=(16, 56, 56))
TINY = dict(FLUX_DEV, num_layers=1, num_single_layers=1, num_attention_heads=2, joint_attention_dim=256,
            pooled_projection_dim=64)


def _qtype(name: str):
    import gguf

    return getattr(gguf.GGMLQuantizationType, name.upper())


def _random_blocks(rows: int, cols: int, qtype, rng: np.random.Generator) -> np.ndarray:
    """Random quant blocks of a (rows, cols) weight with every fp16 scale field small and finite."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    fields = {"Q8_0": [(0, 2)], "Q4_0": [(0, 2)], "Q4_K": [(0, 2), (2, 4)], "Q5_K": [(0, 2), (2, 4)],
              "Q6_K": [(208, 210)]}[qtype.name]
    for lo, hi in fields:
        scale = (rng.random((rows, cols // block)) * 2e-4 + 1e-5).astype(np.float16)
        raw[:, :, lo:hi] = scale.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, cols // block * size)


def write(folder: Path, qtype_name: str, tiny: bool) -> None:
    import gguf
    from diffusers import FluxTransformer2DModel

    folder.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        model = FluxTransformer2DModel(**(TINY if tiny else FLUX_DEV))
    model.save_config(folder / "transformer")
    qtype, rng, t0 = _qtype(qtype_name), np.random.default_rng(0), time.perf_counter()
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    w = gguf.GGUFWriter(str(folder / f"{qtype_name}.gguf"), "flux")
    for name, t in model.state_dict().items():
        if t.ndim == 2 and name.endswith(".weight") and t.shape[1] % block == 0:
            w.add_tensor(name, _random_blocks(t.shape[0], t.shape[1], qtype, rng), raw_dtype=qtype)
        else:
            w.add_tensor(name, (rng.standard_normal(tuple(t.shape), dtype=np.float32) * 0.02))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    size = (folder / f"{qtype_name}.gguf").stat().st_size
    print(f"wrote {folder / f'{qtype_name}.gguf'}: {size / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s")


def _inputs(cfg: dict, device, tiny: bool) -> dict:
    g = torch.Generator("cpu").manual_seed(0)
    img, txt = (256, 32) if tiny else (4096, 512)
    bf = dict(dtype=torch.bfloat16)
    return dict(hidden_states=torch.randn(1, img, cfg["in_channels"], generator=g).to(device, **bf),
                encoder_hidden_states=torch.randn(1, txt, cfg["joint_attention_dim"], generator=g).to(device, **bf),
                pooled_projections=torch.randn(1, cfg["pooled_projection_dim"], generator=g).to(device, **bf),
                timestep=torch.tensor([0.5], device=device, **bf), guidance=torch.tensor([3.5], device=device, **bf),
                img_ids=torch.zeros(img, 3, device=device), txt_ids=torch.zeros(txt, 3, device=device),
                return_dict=False)


def _load(folder: Path, qtype_name: str):
    from diffusers import FluxTransformer2DModel, GGUFQuantizationConfig

    t0 = time.perf_counter()
    m = FluxTransformer2DModel.from_single_file(
        str(folder / f"{qtype_name}.gguf"), quantization_config=GGUFQuantizationConfig(compute_dtype=torch.bfloat16),
        config=str(folder), subfolder="transformer", torch_dtype=torch.bfloat16).eval()
    return m, time.perf_counter() - t0


def _plan(folder: Path, qtype_name: str, budget: str, tiny: bool) -> dict:
    """The setting chunkflow's planner chooses for this format at `budget` (catalog FLUX.1-dev, 1024x1024)."""
    hw = "cpu" if tiny else ("h200" if "H200" in torch.cuda.get_device_name() else "h100-sxm")
    out = folder / f"plan-{qtype_name}.json"
    cmd = [sys.executable, "-m", "chunkflow", "plan", "--model", "flux", "--height", "1024", "--width", "1024",
           "--steps", "8", "--transformer-only", "--mem-budget", budget, "--hardware", hw, "--format", qtype_name,
           "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.read_text())


def timed_forwards(model, kw: dict, repeat: int, device) -> tuple[torch.Tensor, list[float]]:
    """One warm-up forward and `repeat` timed ones (the device synchronized around each, its peak reset): the last
    output and every forward's seconds, the warm-up's first."""
    times = []
    with torch.no_grad():
        for _ in range(repeat + 1):
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            y = model(**kw)[0]
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    return y, times


def time_way(folder: Path, qtype_name: str, way: str, out: Path, budget: str, repeat: int, tiny: bool) -> None:
    import chunkflow

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, load_s = _load(folder, qtype_name)
    cfg, row = dict(model.config), dict(way=way, qtype=qtype_name, load_s=load_s, device=str(device))
    if way == "gpu":
        model.to(device)
    elif way == "chunkflow":
        plan = _plan(folder, qtype_name, budget, tiny)
        o = plan["offload"]
        row.update(plan_setting=o, predicted_step_s=plan["prediction"]["step_time_s"],
                   predicted_peak_bytes=plan["prediction"]["peak_memory_bytes"], plan_format=plan.get("format"))
        handle = chunkflow.offload(model, mode=o["mode"], chunk_size=o["chunk_bytes"], residency=o["residency"],
                                   device=str(device))
    elif way == "leaf":
        model.enable_group_offload(device, offload_device=torch.device("cpu"), offload_type="leaf_level",
                                   use_stream=device.type == "cuda")
    y, times = timed_forwards(model, _inputs(cfg, device, tiny), repeat, device)
    row.update(times_s=times, warmup_s=times[0], median_s=sorted(times[1:])[len(times[1:]) // 2],
               peak_allocated_bytes=torch.cuda.max_memory_allocated() if device.type == "cuda" else None)
    if way == "chunkflow":
        s = handle.stats()
        row["stats"] = {k: getattr(s, k) for k in ("streamed_bytes_per_step", "achieved_residency", "n_streamed_blocks",
                                                   "bytes_offloaded", "pinned_bytes") if hasattr(s, k)}
    torch.save(y.float().cpu(), folder / f"out-{way}-{qtype_name}.pt")
    out.write_text(json.dumps(row, indent=1))
    print(json.dumps({k: v for k, v in row.items() if k != "times_s"}))


def compare(folder: Path, out: Path) -> None:
    files = sorted(folder.glob("out-*.pt"))
    rows = []
    for f in files:
        qtype = f.stem.split("-")[-1]
        ref = folder / f"out-gpu-{qtype}.pt"
        if ref.exists() and f != ref:
            a, b = torch.load(ref), torch.load(f)
            rows.append(dict(file=f.name, reference=ref.name, bit_identical=bool(torch.equal(a, b)),
                             max_abs_diff=float((a - b).abs().max())))
    out.write_text(json.dumps(rows, indent=1))
    print(json.dumps(rows))


def decode_rates(out: Path) -> None:
    """diffusers' dequantization of one FLUX single-block linear1 weight (21504 x 3072) per type, on this device."""
    from diffusers.quantizers.gguf.utils import GGUFParameter, dequantize_gguf_tensor

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rng, rows = np.random.default_rng(0), {}
    for name in ("q8_0", "q6_k", "q5_k", "q4_k", "q4_0"):
        q = _qtype(name)
        p = GGUFParameter(torch.from_numpy(_random_blocks(21504, 3072, q, rng)).to(device), quant_type=q)
        for _ in range(3):
            dequantize_gguf_tensor(p).to(torch.bfloat16)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0, n = time.perf_counter(), 10
        for _ in range(n):
            dequantize_gguf_tensor(p).to(torch.bfloat16)
        if device.type == "cuda":
            torch.cuda.synchronize()
        s = (time.perf_counter() - t0) / n
        rows[name] = dict(seconds=s, bf16_gbps=21504 * 3072 * 2 / s / 1e9, stored_bytes=p.numel())
    out.write_text(json.dumps(dict(device=str(torch.cuda.get_device_name() if device.type == "cuda" else "cpu"),
                                   rates=rows), indent=1))
    print(json.dumps(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["write", "time", "compare", "decode"])
    ap.add_argument("folder", type=Path)
    ap.add_argument("out", type=Path, nargs="?")
    ap.add_argument("--qtype", default="q8_0")
    ap.add_argument("--way", default="gpu", choices=["gpu", "chunkflow", "leaf"])
    ap.add_argument("--mem-budget", default="6GB")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tiny", action="store_true")
    a = ap.parse_args()
    if a.what == "write":
        write(a.folder, a.qtype, a.tiny)
    elif a.what == "time":
        time_way(a.folder, a.qtype, a.way, a.out, a.mem_budget, a.repeat, a.tiny)
    elif a.what == "compare":
        compare(a.folder, a.out)
    else:
        decode_rates(a.folder)


if __name__ == "__main__":
    main()
