"""The exponent-pack codec on a GPU: the ratio, the encoder, the decoder alone, and a block streamed encoded the way
the runtime streams it (encoded chunks copied on a copy stream into a staging ring, decoded on a stream of its own
into the slot), against the same block copied raw; each also with a forward-like GEMM load running on the compute
stream, to see what decoding takes from it. Checks every decoded byte. Writes JSON to the path given.

    python scripts/codec_bench.py OUT.json [--block-mb 320] [--chunk-mb 16] [--search DIR ...]

The values are random bf16 as diffusers initialises its layers (uniform, kaiming) and random normal (std 0.02); with
`--search`, any float tensors in *.safetensors / *.pt / *.pth files found under the folders given are also measured
(a real checkpoint's ratio is what a user gets; random values only approximate it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from chunkflow.runtime.codecs.exponent_pack import encode
from chunkflow.runtime.codecs.exponent_pack_gpu import Chunk, Decode

REPEAT = 15
MB = 1 << 20


def timed(fn, repeat: int = REPEAT) -> float:
    """Median seconds of `fn`, all its streams waited for."""
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def values(kind: str, n: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "kaiming":  # nn.Linear's init for a 3072-wide layer: uniform(-1/sqrt(3072), 1/sqrt(3072))
        return ((torch.rand(n, generator=gen, device="cuda") * 2 - 1) / 3072 ** 0.5).to(torch.bfloat16)
    return (torch.randn(n, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)


class Streamed:
    """A block's chunks encoded in pinned memory and a staging buffer on the device, as the runtime keeps them."""

    def __init__(self, raw: torch.Tensor, chunk: int):
        self.raw = raw
        self.chunks = [(a, min(a + chunk, raw.numel())) for a in range(0, raw.numel(), chunk)]
        encs = [encode(raw[a:b]) for a, b in self.chunks]
        self.meta, off = [], 0
        for e, (a, _) in zip(encs, self.chunks):
            self.meta.append(Chunk(off, a, e.nbytes, e.k, e.n_escapes))
            off += -(-e.stored // 16) * 16
        self.sizes = [e.stored for e in encs]
        self.pinned = torch.empty(off, dtype=torch.uint8, pin_memory=True)
        for c, e in zip(self.meta, encs):
            self.pinned[c.src : c.src + e.stored].copy_(e.data)
        self.stored = sum(self.sizes)
        self.raw_pinned = torch.empty(raw.numel(), dtype=torch.uint8, pin_memory=True)
        self.raw_pinned.copy_(raw)
        self.staging = torch.empty(off, dtype=torch.uint8, device="cuda")
        self.copy_stream = torch.cuda.Stream()
        lo, _hi = torch.cuda.Stream.priority_range()
        self.decode_stream = torch.cuda.Stream(priority=lo)  # the most urgent priority
        self.slot = torch.empty(raw.numel(), dtype=torch.uint8, device="cuda")
        self.block = Decode(self.meta, torch.device("cuda"))
        self.each = [Decode([c._replace(dst=c.dst)], torch.device("cuda")) for c in self.meta]

    def raw_copy(self) -> None:
        with torch.cuda.stream(self.copy_stream):
            self.slot.copy_(self.raw_pinned, non_blocking=True)

    def encoded_copy(self) -> None:
        with torch.cuda.stream(self.copy_stream):
            for c, n in zip(self.meta, self.sizes):
                self.staging[c.src : c.src + n].copy_(self.pinned[c.src : c.src + n], non_blocking=True)

    def streamed(self, per_chunk: bool = False) -> None:
        """Copy every chunk encoded, decode on the decode stream: once the block is copied (one launch), or
        `per_chunk` after each chunk's copy."""
        cs, ds = self.copy_stream, self.decode_stream
        for c, n, dec in zip(self.meta, self.sizes, self.each):
            with torch.cuda.stream(cs):
                self.staging[c.src : c.src + n].copy_(self.pinned[c.src : c.src + n], non_blocking=True)
            if per_chunk:
                copied = torch.cuda.Event()
                copied.record(cs)
                with torch.cuda.stream(ds):
                    ds.wait_event(copied)
                    dec.run(self.staging, self.slot)
        if not per_chunk:
            copied = torch.cuda.Event()
            copied.record(cs)
            with torch.cuda.stream(ds):
                ds.wait_event(copied)
                self.block.run(self.staging, self.slot)

    def decode_only(self) -> None:
        self.block.run(self.staging, self.slot)


def gemm_load(seconds: float) -> tuple:
    """A forward-like compute load on the current stream: bf16 GEMMs totalling about `seconds` alone."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    one = timed(lambda: a @ b, 5)
    n = max(1, round(seconds / one))

    def run():
        for _ in range(n):
            a @ b
    return run, n, one


def real_tensors(folders: list[str], limit: int = 512 * MB) -> list[dict]:
    """The ratio on float tensors of checkpoint files found under `folders` (cast to bf16 where stored wider)."""
    out = []
    for folder in folders:
        for path in sorted(Path(folder).rglob("*")):
            if path.suffix not in (".safetensors", ".pt", ".pth") or not path.is_file() or path.stat().st_size < MB:
                continue
            try:
                if path.suffix == ".safetensors":
                    from safetensors.torch import load_file
                    tensors = load_file(str(path))
                else:
                    obj = torch.load(path, map_location="cpu", weights_only=True)
                    tensors = obj if isinstance(obj, dict) else {}
            except Exception as exc:  # noqa: BLE001 - a file we cannot read is reported, not fatal
                out.append({"file": str(path), "error": str(exc)[:200]})
                continue
            flat = [t.detach().reshape(-1) for t in tensors.values()
                    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() >= 4096]
            if not flat:
                continue
            dtypes = sorted({str(t.dtype) for t in flat})
            data = torch.cat([t.to(torch.bfloat16) for t in flat])[: limit // 2]
            raw = data.view(torch.uint8).cuda()
            stored = sum(encode(raw[a : a + 16 * MB]).stored for a in range(0, raw.numel(), 16 * MB))
            out.append({"file": str(path), "dtypes": dtypes, "bytes_bf16": raw.numel(), "ratio": stored / raw.numel()})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--block-mb", type=int, default=320)
    ap.add_argument("--chunk-mb", type=int, default=16)
    ap.add_argument("--search", nargs="*", default=[])
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "block_bytes": args.block_mb * MB,
              "chunk_bytes": args.chunk_mb * MB, "repeat": REPEAT, "cases": {}}
    for kind in ("kaiming", "normal"):
        raw = values(kind, args.block_mb * MB // 2, gen).view(torch.uint8)
        t_enc = timed(lambda: encode(raw[: args.chunk_mb * MB]), 5)
        s = Streamed(raw, args.chunk_mb * MB)
        case = {"ratio": s.stored / raw.numel(), "encode_s_per_chunk": t_enc,
                "encode_gbps": args.chunk_mb * MB / t_enc / 1e9}
        s.slot.zero_()
        s.streamed()
        torch.cuda.synchronize()
        assert torch.equal(s.slot, raw), "decoded bytes differ"
        s.slot.zero_()
        s.streamed(per_chunk=True)
        torch.cuda.synchronize()
        assert torch.equal(s.slot, raw), "decoded bytes differ (per chunk)"
        s.encoded_copy()
        torch.cuda.synchronize()
        times = {"raw_copy": timed(s.raw_copy), "encoded_copy": timed(s.encoded_copy), "decode": timed(s.decode_only),
                 "streamed": timed(s.streamed), "streamed_per_chunk": timed(lambda: s.streamed(per_chunk=True))}
        t0 = time.perf_counter()
        for _ in range(50):
            s.block.run(s.staging, s.slot)
        times["launch_cpu_s"] = (time.perf_counter() - t0) / 50
        torch.cuda.synchronize()
        case["seconds"] = times
        case["rates_gbps"] = {"raw_copy": raw.numel() / times["raw_copy"] / 1e9,
                              "encoded_copy_link": s.stored / times["encoded_copy"] / 1e9,
                              "decode_output": raw.numel() / times["decode"] / 1e9,
                              "streamed_effective": raw.numel() / times["streamed"] / 1e9}
        run, n, one = gemm_load(times["raw_copy"])
        alone = timed(run, 5)

        def with_(fn):
            def both():
                fn()
                run()
            return both
        case["with_compute"] = {"gemms": n, "gemm_s": one, "compute_alone": alone,
                                "raw_copy_and_compute": timed(with_(s.raw_copy), 5),
                                "streamed_and_compute": timed(with_(s.streamed), 5),
                                "streamed_per_chunk_and_compute": timed(with_(lambda: s.streamed(per_chunk=True)), 5)}
        s.slot.zero_()
        s.streamed()
        run()
        torch.cuda.synchronize()
        assert torch.equal(s.slot, raw), "decoded bytes differ under load"
        result["cases"][kind] = case
        print(kind, json.dumps(case, indent=1), flush=True)
        del s
        torch.cuda.empty_cache()
    if args.search:
        result["real_tensors"] = real_tensors(args.search)
        print(json.dumps(result["real_tensors"], indent=1), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "0")
    main()
