"""Variants of the exponent-pack decode kernel timed side by side on one GPU (the product's is
chunkflow.runtime.codecs.exponent_pack_gpu): each decodes the same encoded block in one launch, its bytes checked.

    python scripts/codec_kernels.py OUT.json [--block-mb 320]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import triton
import triton.language as tl

from chunkflow.runtime.codecs.exponent_pack import GROUP, encode
from chunkflow.runtime.codecs.exponent_pack_gpu import Chunk, Decode, _decode_kernel


@triton.jit
def _rows_kernel(data, out, desc, G: tl.constexpr, D: tl.constexpr):
    """A group as [G/32, 32]: a row is the 32 words of one plane word; ranks of escapes by two short scans."""
    g = tl.program_id(0).to(tl.int64)  # the group within its chunk
    row = desc + tl.program_id(1).to(tl.int64) * D  # the chunk
    words = tl.load(row + 1)
    K = tl.load(row + 2).to(tl.int32)
    src = data + tl.load(row + 3)
    dst = (out + tl.load(row + 4)).to(tl.pointer_type(tl.int16))
    R: tl.constexpr = G // 32
    rows = tl.arange(0, R)
    cols = tl.arange(0, 32)
    i2 = (g * G + rows[:, None] * 32 + cols[None, :])
    valid = i2 < words
    if K == 0:
        lo = tl.load(src + 2 * i2, mask=valid, other=0).to(tl.int32)
        hi = tl.load(src + 2 * i2 + 1, mask=valid, other=0).to(tl.int32)
        word = lo | (hi << 8)
    else:
        s = tl.load(src + tl.load(row + 5) + i2, mask=valid, other=0).to(tl.int32)
        plane = (src + tl.load(row + 6) + g * K * (G // 8)).to(tl.pointer_type(tl.int32))
        idx = tl.zeros([R, 32], dtype=tl.int32)
        for p in range(K):
            w = tl.load(plane + p * R + rows, mask=g * G + rows * 32 < words, other=0)
            idx |= ((w[:, None] >> cols[None, :]) & 1) << p
        escape = (1 << K) - 1
        esc = idx == escape
        e_tab = tl.load(src + idx, mask=valid & (idx < escape), other=0).to(tl.int32)
        esc_i = esc.to(tl.int32)
        per_row = tl.sum(esc_i, axis=1)
        before = tl.cumsum(per_row, axis=0) - per_row
        rank = before[:, None] + tl.cumsum(esc_i, axis=1) - esc_i
        first = tl.load((src + tl.load(row + 7)).to(tl.pointer_type(tl.int32)) + g, mask=g * G < words, other=0)
        e_esc = tl.load(src + tl.load(row + 8) + first + rank, mask=valid & esc, other=0).to(tl.int32)
        e = tl.where(esc, e_esc, e_tab)
        word = ((s & 0x80) << 8) | (e << 7) | (s & 0x7F)
    tl.store(dst + i2, word.to(tl.int16), mask=valid)


def timed(fn, repeat=20):
    ts = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--block-mb", type=int, default=320)
    args = ap.parse_args()
    MB = 1 << 20
    g = torch.Generator(device="cuda").manual_seed(0)
    raw = ((torch.rand(args.block_mb * MB // 2, generator=g, device="cuda") * 2 - 1) / 55).to(torch.bfloat16)
    raw = raw.view(torch.uint8)
    chunk = 16 * MB
    meta, encs, off = [], [], 0
    for a in range(0, raw.numel(), chunk):
        e = encode(raw[a : a + chunk])
        meta.append(Chunk(off, a, e.nbytes, e.k, e.n_escapes))
        encs.append(e)
        off += -(-e.stored // 16) * 16
    src = torch.zeros(off, dtype=torch.uint8, device="cuda")
    for c, e in zip(meta, encs):
        src[c.src : c.src + e.stored] = e.data
    dec = Decode(meta, torch.device("cuda"))
    out = torch.empty_like(raw)
    res = {"device": torch.cuda.get_device_name(), "bytes": raw.numel(), "copy_d2d": timed(lambda: out.copy_(raw))}
    variants = {}
    for warps in (2, 4, 8):
        variants[f"flat_w{warps}"] = lambda w=warps: _decode_kernel[dec.grid](src, out, dec.table,
                                                                                    G=GROUP, D=9, num_warps=w)
        variants[f"rows_w{warps}"] = lambda w=warps: _rows_kernel[dec.grid](src, out, dec.table,
                                                                                   G=GROUP, D=9, num_warps=w)
    for name, fn in variants.items():
        out.zero_()
        try:
            fn()
            torch.cuda.synchronize()
            ok = bool(torch.equal(out, raw))
            t = timed(fn)
            res[name] = {"ok": ok, "s": t, "gbps_out": raw.numel() / t / 1e9}
        except Exception as exc:  # noqa: BLE001
            res[name] = {"error": str(exc)[:300]}
        print(name, res[name], flush=True)
    open(args.out, "w").write(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
