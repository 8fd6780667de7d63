"""Issue 52's GPU evidence, second round: a stored-format transformer (GGUF Q8_0/Q4_0, fp8-scaled) of FLUX.1-dev or
Wan2.1-14B streamed as stored, against the same file all on the GPU and diffusers' leaf-level group offloading of
it, each way its own process.

    python3 scripts/format_bench.py write DIR --model flux|wan --format q8_0|q4_0|fp8-scaled [--tiny]
    python3 scripts/format_bench.py time DIR OUT.json --model M --format F --way gpu|chunkflow|forward|leaf
    python3 scripts/format_bench.py compare DIR OUT.json
    python3 scripts/format_bench.py decode OUT.json          # dequantization per type at two sizes: const + rate

The file: the model's real architecture (`--tiny`: one or two blocks, for a CPU dry run) in diffusers' key names,
random values (no time depends on them): GGUF with every 2-D block weight whose rows fit the type's blocks in that
type (random quant blocks, finite fp16 scales), the rest F32 (as city96's files keep 1-D tensors); fp8-scaled with
every linear weight of a block as random finite e4m3 bytes and a float32 `scale_weight`, the rest bf16. The module
is the one chunkflow's `--transformer FILE` builds (chunkflow.formats.load: diffusers' `from_single_file` +
GGUFQuantizationConfig for GGUF). Workloads: FLUX 1024x1024 (4096 image + 512 text tokens); Wan 480x832x81
(21x60x104 latents, 32760 tokens, 512 text tokens). One warm-up forward, then `--repeat` timed, median.
`chunkflow` takes the setting `chunkflow plan --model M --format F --transformer-only --mem-budget` chooses on this
GPU's catalog profile (its prediction written beside), streamed blocks decoded ahead of their forward; `forward` the
same setting with every layer dequantizing in its own forward (diffusers' way). Every way saves its output
(DIR/out-WAY-MODEL-FORMAT.pt); `compare` checks them bit for bit against the `gpu` way's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_bench import FLUX_DEV, _qtype, _random_blocks, timed_forwards  # noqa: E402

WAN_14B = dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
               text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
               qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
MODELS = {"flux": ("FluxTransformer2DModel", FLUX_DEV, "flux"), "wan": ("WanTransformer3DModel", WAN_14B, "wan2.1-14b")}
TINY = {"flux": dict(FLUX_DEV, num_layers=1, num_single_layers=1, num_attention_heads=2, joint_attention_dim=256,
                     pooled_projection_dim=64),
        "wan": dict(WAN_14B, num_attention_heads=2, num_layers=2, text_dim=256, ffn_dim=512)}
WORKLOAD = {"flux": ["--height", "1024", "--width", "1024", "--steps", "8"],
            "wan": ["--height", "480", "--width", "832", "--frames", "81", "--steps", "50"]}
TIGHT = os.environ.get("CHUNKFLOW_BENCH_TIGHT", "1.01")  # the `tight` way's --max-slowdown: the fastest in the budget
BLOCK_PREFIXES = ("transformer_blocks.", "single_transformer_blocks.", "blocks.")


def _cls(model: str):
    import diffusers

    return getattr(diffusers, MODELS[model][0])


def _config(model: str, tiny: bool) -> dict:
    return TINY[model] if tiny else MODELS[model][1]


def _path(folder: Path, model: str, fmt: str) -> Path:
    return folder / f"{model}-{fmt}.{'safetensors' if fmt == 'fp8-scaled' else 'gguf'}"


def _meta(model: str, tiny: bool) -> torch.nn.Module:
    with torch.device("meta"):
        return _cls(model)(**_config(model, tiny))


def _write_gguf(path: Path, m: torch.nn.Module, fmt: str, arch: str) -> None:
    import gguf

    qtype, rng = _qtype(fmt), np.random.default_rng(0)
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    w = gguf.GGUFWriter(str(path), arch)
    for name, t in m.state_dict().items():
        if t.ndim == 2 and name.endswith(".weight") and t.shape[1] % block == 0:
            w.add_tensor(name, _random_blocks(t.shape[0], t.shape[1], qtype, rng), raw_dtype=qtype)
        else:
            w.add_tensor(name, (rng.standard_normal(tuple(t.shape), dtype=np.float32) * 0.02))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _random_e4m3(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Random finite float8_e4m3fn values (the NaN codes 0x7f/0xff made 0)."""
    raw = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    raw[(raw & 0x7F) == 0x7F] = 0
    return raw.view(torch.float8_e4m3fn)


def _write_fp8_scaled(path: Path, m: torch.nn.Module) -> None:
    from safetensors.torch import save_file

    g, out = torch.Generator().manual_seed(0), {}
    linears = {f"{n}.weight" for n, mod in m.named_modules() if isinstance(mod, torch.nn.Linear)}
    for name, t in m.state_dict().items():
        if name in linears and name.startswith(BLOCK_PREFIXES):
            out[name] = _random_e4m3(tuple(t.shape), g)
            out[name[: -len("weight")] + "scale_weight"] = torch.tensor(1e-3 + 1e-3 * torch.rand((), generator=g).item())
        else:
            out[name] = (torch.randn(tuple(t.shape), generator=g) * 0.02).to(torch.bfloat16)
    out["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    save_file(out, str(path))


def write(folder: Path, model: str, fmt: str, tiny: bool) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    m, t0 = _meta(model, tiny), time.perf_counter()
    m.save_config(folder / model / "transformer")
    path = _path(folder, model, fmt)
    if fmt == "fp8-scaled":
        _write_fp8_scaled(path, m)
    else:
        _write_gguf(path, m, fmt, "flux" if model == "flux" else "wan")
    print(f"wrote {path}: {path.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s")


def _inputs(model: str, cfg: dict, device, tiny: bool) -> dict:
    g, bf = torch.Generator("cpu").manual_seed(0), dict(dtype=torch.bfloat16)
    if model == "flux":
        img, txt = (256, 32) if tiny else (4096, 512)
        return dict(hidden_states=torch.randn(1, img, cfg["in_channels"], generator=g).to(device, **bf),
                    encoder_hidden_states=torch.randn(1, txt, cfg["joint_attention_dim"], generator=g).to(device, **bf),
                    pooled_projections=torch.randn(1, cfg["pooled_projection_dim"], generator=g).to(device, **bf),
                    timestep=torch.tensor([0.5], device=device, **bf),
                    guidance=torch.tensor([3.5], device=device, **bf),
                    img_ids=torch.zeros(img, 3, device=device), txt_ids=torch.zeros(txt, 3, device=device),
                    return_dict=False)
    f, h, w, txt = (2, 8, 8, 16) if tiny else (21, 60, 104, 512)
    return dict(hidden_states=torch.randn(1, cfg["in_channels"], f, h, w, generator=g).to(device, **bf),
                encoder_hidden_states=torch.randn(1, txt, cfg["text_dim"], generator=g).to(device, **bf),
                timestep=torch.tensor([500], device=device), return_dict=False)


def _load(folder: Path, model: str, fmt: str):
    from chunkflow import formats

    t0 = time.perf_counter()
    m = formats.load(_path(folder, model, fmt), _cls(model), folder / model / "transformer", torch.bfloat16)
    return m.eval(), time.perf_counter() - t0


def _plan(folder: Path, model: str, fmt: str, budget: str, tiny: bool, slowdown: str | None = None) -> dict:
    """The setting chunkflow's planner chooses for this format at `budget` (the catalog model, its workload;
    `slowdown`: its --max-slowdown, the default 1.05 where None)."""
    profile = os.environ.get("CHUNKFLOW_BENCH_PROFILE", "")
    if tiny:
        hw = "cpu"
    elif profile and Path(profile).is_file():  # the profile calibrate measured on this machine
        hw = profile
    else:
        hw = "h200" if "H200" in torch.cuda.get_device_name() else "h100-sxm"
    out = folder / f"plan-{model}-{fmt}{'-' + slowdown if slowdown else ''}.json"
    cmd = [sys.executable, "-m", "chunkflow", "plan", "--model", MODELS[model][2], *WORKLOAD[model],
           "--transformer-only", "--mem-budget", budget, "--hardware", hw, "--format", fmt, "--out", str(out),
           *(["--max-slowdown", slowdown] if slowdown else [])]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}\n{done.stdout}{done.stderr}")
    return json.loads(out.read_text())


def _offload(model_: torch.nn.Module, plan: dict, device, way: str, row: dict):
    import chunkflow

    o = plan["offload"]
    row.update(plan_setting=o, plan_hardware=plan.get("hardware", {}).get("name") if isinstance(plan.get("hardware"), dict) else None, predicted_step_s=plan["prediction"]["step_time_s"],
               predicted_peak_bytes=plan["prediction"]["peak_memory_bytes"], plan_format=plan.get("format"))
    kw = dict(mode=o["mode"], chunk_size=o["chunk_bytes"], residency=o["residency"], device=str(device))
    kw["decode"] = "ahead" if way == "chunkflow" else "forward"
    return chunkflow.offload(model_, **kw)


def time_way(folder: Path, model: str, fmt: str, way: str, out: Path, budget: str, repeat: int, tiny: bool) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    m, load_s = _load(folder, model, fmt)
    cfg = dict(m.config)
    row = dict(way=way, model=model, format=fmt, load_s=load_s, device=str(device), mem_budget=budget,
               gpu=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", date=time.strftime("%F %T"))
    handle = None
    if way == "gpu":
        m.to(device)
    elif way in ("chunkflow", "forward"):
        handle = _offload(m, _plan(folder, model, fmt, budget, tiny), device, way, row)
    elif way == "tight":  # the fastest setting inside the budget the planner finds (--max-slowdown TIGHT)
        handle = _offload(m, _plan(folder, model, fmt, budget, tiny, TIGHT), device, way, row)
    elif way == "leaf":
        m.enable_group_offload(device, offload_device=torch.device("cpu"), offload_type="leaf_level",
                               use_stream=device.type == "cuda")
    y, times = timed_forwards(m, _inputs(model, cfg, device, tiny), repeat, device)
    rest = sorted(times[1:])
    row.update(times_s=times, warmup_s=times[0], median_s=rest[len(rest) // 2],
               peak_allocated_bytes=torch.cuda.max_memory_allocated() if device.type == "cuda" else None)
    if handle is not None:
        s = handle.stats()
        row["stats"] = {k: v for k, v in vars(s).items() if isinstance(v, (int, float, str, bool))} \
            if hasattr(s, "__dict__") else str(s)
        if "predicted_step_s" in row:
            row["plan_error"] = row["predicted_step_s"] / row["median_s"] - 1
        from chunkflow.runtime.codecs.probe import measure_decode

        probe = measure_decode(handle.layouts, device)  # what `chunkflow run` reports as the decode measured
        row["decode_probe"] = probe._asdict() if probe is not None else None
    torch.save(y.float().cpu(), folder / f"out-{way}-{model}-{fmt}.pt")
    out.write_text(json.dumps(row, indent=1, default=str))
    print(json.dumps({k: v for k, v in row.items() if k not in ("times_s", "stats")}, default=str))


def _copy_s(nbytes: int, chunk: int, device) -> float:
    """Seconds to copy `nbytes` host-to-device from page-locked memory in `chunk`-byte copies on a side stream (the
    link alone, as the streamer issues it), the median of three."""
    if device.type != "cuda":
        return 0.0
    chunk = max(1, min(chunk, 1 << 30))
    src = torch.empty(max(chunk, 1 << 28) // chunk * chunk, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(chunk, dtype=torch.uint8, device=device)
    stream, times = torch.cuda.Stream(), []
    for _ in range(4):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            for a in range(0, nbytes, chunk):
                at = a % src.numel()
                k = min(chunk, nbytes - a, src.numel() - at)
                dst[:k].copy_(src[at:at + k], non_blocking=True)
        stream.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[1]


def phases(folder: Path, model: str, fmt: str, out: Path, budget: str, repeat: int, tiny: bool) -> None:
    """Each phase of the plan's step on its own: compute (the same architecture in bf16, all on the GPU: no decode),
    the link (the plan's bytes a step copied alone, in its chunks), and the decode (the `gpu` way's time less the
    compute, from `compare`); with what the plans (this format's and bf16's) price each at."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    plan, bf16 = _plan(folder, model, fmt, budget, tiny), _plan(folder, model, "bf16", budget, tiny)
    with torch.device(device):
        m = _cls(model).from_config(_config(model, tiny)).to(torch.bfloat16).eval()
    _, times = timed_forwards(m, _inputs(model, dict(m.config), device, tiny), repeat, device)
    del m
    compute = sorted(times[1:])[len(times[1:]) // 2]
    fmt_row, o = plan.get("format") or {}, plan["offload"]
    h2d = fmt_row.get("h2d_bytes_per_step") or plan["prediction"].get("h2d_bytes_per_step") or 0
    hw = plan.get("hardware", {}) if isinstance(plan.get("hardware"), dict) else {}
    row = dict(way="phases", model=model, format=fmt, date=time.strftime("%F %T"), mem_budget=budget,
               gpu=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               compute_s=compute, compute_times_s=times, copy_s=_copy_s(int(h2d), int(o["chunk_bytes"]), device),
               h2d_bytes_per_step=h2d, plan_compute_s=bf16["prediction"]["baselines"]["none"]["step_time_s"],
               plan_decode_s=fmt_row.get("decode_s_per_step"),
               plan_copy_s=h2d / (hw["h2d_gbps"] * hw.get("eta_pref", 1.0) * 1e9) if hw.get("h2d_gbps") else None,
               plan_gpu_s=plan["prediction"]["baselines"]["none"]["step_time_s"],
               plan_step_s=plan["prediction"]["step_time_s"])
    out.write_text(json.dumps(row, indent=1, default=str))
    print(json.dumps({k: v for k, v in row.items() if k != "compute_times_s"}, default=str))


def compare(folder: Path, out: Path) -> None:
    rows = []
    for f in sorted(folder.glob("out-*.pt")):
        way, rest = f.stem.removeprefix("out-").split("-", 1)
        ref = folder / f"out-gpu-{rest}.pt"
        if ref.exists() and f != ref:
            a, b = torch.load(ref), torch.load(f)
            rows.append(dict(file=f.name, reference=ref.name, bit_identical=bool(torch.equal(a, b)),
                             max_abs_diff=float((a - b).abs().max())))
    out.write_text(json.dumps(rows, indent=1))
    print(json.dumps(rows))


def _dequant(fmt: str, rows: int, cols: int, device, rng):
    """(the dequantizing call, its stored bytes) of one (rows, cols) weight in `fmt`, as the layer runs it."""
    if fmt == "fp8-scaled":
        w = _random_e4m3((rows, cols), torch.Generator().manual_seed(0)).to(device)
        scale = torch.tensor(1e-3, device=device)
        return (lambda: w.to(torch.bfloat16) * scale.to(torch.bfloat16)), w.numel()
    from diffusers.quantizers.gguf.utils import GGUFParameter, dequantize_gguf_tensor

    p = GGUFParameter(torch.from_numpy(_random_blocks(rows, cols, _qtype(fmt), rng)).to(device), quant_type=_qtype(fmt))
    return (lambda: dequantize_gguf_tensor(p).to(torch.bfloat16)), p.numel()


def decode_rates(out: Path) -> None:
    """Each format's dequantization of a small (3072x3072) and a large (21504x3072) weight on this device: seconds a
    call, so a fixed cost per weight and a rate per byte follow."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rng, rows = np.random.default_rng(0), {}
    for fmt in ("q8_0", "q6_k", "q5_k", "q4_k", "q4_0", "fp8-scaled"):
        for r, c in ((3072, 3072), (21504, 3072)):
            call, stored = _dequant(fmt, r, c, device, rng)
            for _ in range(3):
                call()
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0, n = time.perf_counter(), 20
            for _ in range(n):
                call()
            if device.type == "cuda":
                torch.cuda.synchronize()
            s = (time.perf_counter() - t0) / n
            rows[f"{fmt}@{r}x{c}"] = dict(seconds=s, bf16_gbps=r * c * 2 / s / 1e9, stored_bytes=stored)
    out.write_text(json.dumps(dict(device=str(torch.cuda.get_device_name() if device.type == "cuda" else "cpu"),
                                   date=time.strftime("%F %T"), rates=rows), indent=1))
    print(json.dumps(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["write", "time", "compare", "decode"])
    ap.add_argument("folder", type=Path)
    ap.add_argument("out", type=Path, nargs="?")
    ap.add_argument("--model", default="flux", choices=sorted(MODELS))
    ap.add_argument("--format", default="q8_0", choices=["q8_0", "q6_k", "q5_k", "q4_k", "q4_0", "fp8-scaled"])
    ap.add_argument("--way", default="gpu", choices=["gpu", "chunkflow", "forward", "tight", "leaf", "phases"])
    ap.add_argument("--mem-budget", default="6GB")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tiny", action="store_true")
    a = ap.parse_args()
    if a.what == "write":
        write(a.folder, a.model, a.format, a.tiny)
    elif a.what == "time" and a.way == "phases":
        phases(a.folder, a.model, a.format, a.out, a.mem_budget, a.repeat, a.tiny)
    elif a.what == "time":
        time_way(a.folder, a.model, a.format, a.way, a.out, a.mem_budget, a.repeat, a.tiny)
    elif a.what == "compare":
        compare(a.folder, a.out)
    else:
        decode_rates(a.folder)


if __name__ == "__main__":
    main()
