"""Issue 35's runtime cases on a GPU (real CUDA streams, pinned stores, the disk tier's page-locked ring): each
operation on a model offloaded to cuda compared bit for bit with the same operation on the same model on cuda without
offload. The CPU tests (tests/test_normal_model_3.py) run the same cases with synchronous copies.

    python3 docs/data/h200-normal-3/check_cuda.py OUT_DIR      # writes OUT_DIR/normal3.json and prints a table
"""

from __future__ import annotations

import io
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from torch import nn

from chunkflow.models.build import build_transformer
from chunkflow.models.inputs import make_inputs
from chunkflow.runtime.disk import DiskTierError
from chunkflow_planner.catalog import get_model
from chunkflow_planner.offload import OffloadConfig

DEV = os.environ.get("DEVICE", "cuda")
TIERS = {"host": dict(mode="chunkflow", chunk_bytes=1000, residency=0.0),
         "resident": dict(mode="chunkflow", chunk_bytes=1000, residency=0.5),
         "layerwise": dict(mode="layerwise"),
         "disk": dict(mode="chunkflow", chunk_bytes=1000, residency=0.0, disk_blocks=2)}


def saved(root: Path, model: str, dtype, shard: str) -> Path:
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    folder = root / model
    WanTransformer3DModel(**get_model(model).diffusers.config).eval().to(dtype).save_pretrained(
        folder, safe_serialization=True, max_shard_size=shard)
    return folder


def build(folder, model="tiny-wan", dtype=torch.float32, **cfg):
    return build_transformer(model, weights=folder, dtype=dtype, device=DEV, config=OffloadConfig(**cfg))


def forward(m, model="tiny-wan", dtype=torch.float32):
    kw = make_inputs(get_model(model), None, dtype, DEV, seed=1)
    with torch.no_grad():
        return m(**kw)[0].float().cpu()


def hook_once(module, action):
    calls = []

    def hook(mod, args):
        if not calls:
            with torch.no_grad():
                action(mod)
        calls.append(1)
    module.register_forward_pre_hook(hook)


OPS = {
    "replace_by_attribute": lambda m: setattr(m.blocks[0].ffn.net[0].proj, "weight", nn.Parameter(
        torch.full_like(m.blocks[0].ffn.net[0].proj.weight.detach(), 0.01))),
    "load_assign": lambda m: m.load_state_dict({k: v.clone() * 0.5 for k, v in m.state_dict().items()}, assign=True),
    "swap_tensors": lambda m: torch.utils.swap_tensors(m.blocks[1].attn1.to_q.weight, nn.Parameter(
        torch.full_like(m.blocks[1].attn1.to_q.weight.detach(), 0.02))),
    "own_weight_in_place": lambda m: hook_once(m.blocks[0].ffn.net[0].proj, lambda mod: mod.weight.mul_(1.5)),
    "own_weight_by_data": lambda m: hook_once(m.blocks[1].attn1.to_q, lambda mod: setattr(
        mod.weight, "data", torch.full_like(mod.weight.data, .03))),
    "later_block_in_place": lambda m: hook_once(m.blocks[0].ffn.net[0].proj,
                                                lambda mod: m.blocks[1].ffn.net[0].proj.weight.mul_(1.5)),
    "earlier_block_in_place": lambda m: hook_once(m.blocks[1].ffn.net[0].proj,
                                                  lambda mod: m.blocks[0].ffn.net[2].weight.add_(0.01)),
    "whole_block_from_inside": lambda m: hook_once(m.blocks[0].attn1.to_q,
                                                   lambda mod: [p.mul_(0.9) for p in m.blocks[0].parameters()]),
}


def same_as_without_offload(folder, cfg, op) -> bool:
    ref, h_ref = build(folder, mode="none")
    off, h_off = build(folder, **cfg)
    outs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for m in (ref, off):
            op(m)
            outs.append([forward(m) for _ in range(3)])
    ok = all(torch.equal(a, b) for a, b in zip(*outs))
    sd_ref, sd_off = ref.state_dict(), off.state_dict()
    ok &= all(torch.equal(sd_ref[k].cpu(), sd_off[k].cpu()) for k in sd_ref)
    h_off.remove()
    h_ref.remove()
    ok &= all(torch.equal(sd_ref[k].cpu(), v.cpu()) for k, v in off.state_dict().items())
    return bool(ok)


def weight_kept(folder, cfg, ref_cfg) -> bool:
    kept, outs = {}, {}
    for name, c in (("ref", ref_cfg), ("off", cfg)):
        m, h = build(folder, "demo-wan", torch.bfloat16, **c)
        for i in (1, 2):
            m.blocks[i].ffn.net[0].proj.register_forward_pre_hook(
                lambda mod, args, key=(name, i): None if kept.setdefault(key, mod.weight.detach()) is None else None)
        outs[name] = [forward(m, "demo-wan", torch.bfloat16) for _ in range(2)]
        if DEV == "cuda":
            torch.cuda.synchronize()
        h.remove()
    return all(torch.equal(kept[("ref", i)].float().cpu(), kept[("off", i)].float().cpu()) for i in (1, 2)) and \
        all(torch.equal(a, b) for a, b in zip(outs["ref"], outs["off"]))


def rewrite_refused(root) -> bool:
    folder = saved(root / "rw", "tiny-wan", torch.float32, "30KB")
    m, h = build(folder, **TIERS["disk"])
    forward(m)
    shard = max(folder.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    st = os.stat(shard)
    with open(shard, "r+b") as f:
        f.seek(st.st_size - 64)
        f.write(b"\x11" * 64)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    try:
        forward(m)
        forward(m)
        return False
    except DiskTierError:
        h.discard()
        return True


def shards_equal(folder, root, tier) -> bool:
    ref, h_ref = build(folder, mode="none")
    off, h_off = build(folder, **TIERS[tier])
    forward(off)
    layouts = []
    for name, m in (("ref", ref), ("off", off)):
        out = root / f"save-{tier}-{name}"
        m.save_pretrained(out, max_shard_size="20KB")
        layouts.append(sorted((p.name, p.stat().st_size) for p in out.glob("*.safetensors")))
    sizes = []
    for m in (ref, off):  # (on the host both: torch.save's bytes name each tensor's device)
        buf = io.BytesIO()
        torch.save({k: v.cpu() for k, v in m.blocks[0].state_dict().items()}, buf)
        sizes.append(len(buf.getvalue()))
    h_off.remove()
    h_ref.remove()
    if layouts[0] != layouts[1] or sizes[0] != sizes[1]:
        print(f"  save {tier}: shards {layouts[0]} vs {layouts[1]}; torch.save {sizes[0]} vs {sizes[1]}")
    return layouts[0] == layouts[1] and sizes[0] == sizes[1]


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp())
    tiny = saved(root, "tiny-wan", torch.float32, "30KB")
    demo = saved(root, "demo-wan", torch.bfloat16, "2MB")
    results = {}
    for tier, cfg in TIERS.items():
        for name, op in OPS.items():
            results[f"{name}/{tier}"] = same_as_without_offload(tiny, cfg, op)
    fp8 = dict(mode="chunkflow", chunk_bytes=100_000, residency=0.0, weight_dtype="fp8_e4m3")
    fp8_ref = dict(fp8, residency=1.0)
    for tier, cfg, ref in (("host", TIERS["host"] | {"chunk_bytes": 100_000}, dict(mode="none")),
                           ("layerwise", TIERS["layerwise"], dict(mode="none")),
                           ("disk", TIERS["disk"] | {"chunk_bytes": 100_000}, dict(mode="none")),
                           ("fp8", fp8, fp8_ref), ("fp8-copy", fp8 | {"fp8_cast": "copy"}, fp8_ref)):
        results[f"weight_kept_from_forward/{tier}"] = weight_kept(demo, cfg, ref)
    results["rewrite_in_place_refused/disk"] = rewrite_refused(root)
    for tier in ("host", "resident", "disk"):
        results[f"save_shards_and_torch_save/{tier}"] = shards_equal(tiny, root, tier)
    env = {"gpu": torch.cuda.get_device_name() if DEV == "cuda" else "cpu", "torch": torch.__version__}
    (out / "normal3.json").write_text(json.dumps({"env": env, "results": results}, indent=1))
    for k, v in results.items():
        print(f"{k:45s} {'exact' if v else 'WRONG'}")
    print(f"{sum(results.values())} of {len(results)} exact on {env['gpu']}")


if __name__ == "__main__":
    main()
