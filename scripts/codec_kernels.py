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
from chunkflow.runtime.codecs.exponent_pack_gpu import Chunk, Decode


@triton.jit
def _variant(data, out, desc, G: tl.constexpr, D: tl.constexpr, GPP: tl.constexpr, MODE: tl.constexpr,
             BCAST: tl.constexpr):
    """The product's kernel with switches: GPP groups a program (unrolled), MODE 0 whole, 1 no escapes, 2 no index
    planes, 3 the sign-mantissa bytes only; BCAST: index plane words loaded once and broadcast, not gathered."""
    row = desc + tl.program_id(1).to(tl.int64) * D
    words = tl.load(row + 1).to(tl.int32)
    K = tl.load(row + 2).to(tl.int32)
    src = data + tl.load(row + 3)
    dst = (out + tl.load(row + 4)).to(tl.pointer_type(tl.int16))
    sm_at = tl.load(row + 5)
    planes_at = tl.load(row + 6)
    starts_at = tl.load(row + 7)
    esc_at = tl.load(row + 8)
    j = tl.arange(0, G)
    for q in tl.static_range(GPP):
        g = tl.program_id(0) * GPP + q
        i = g * G + j
        valid = i < words
        s = tl.load(src + sm_at + i, mask=valid, other=0).to(tl.int32)
        if MODE == 3:
            word = s
        else:
            idx = tl.zeros([G], dtype=tl.int32)
            if MODE != 2:
                plane = src + planes_at + (g * K * (G // 8)).to(tl.int64)
                for p in range(K):
                    if BCAST:
                        w = tl.load((plane + p * (G // 8)).to(tl.pointer_type(tl.int32)) + tl.arange(0, G // 32),
                                    mask=g * G + tl.arange(0, G // 32) * 32 < words, other=0)
                        wb = tl.reshape(tl.broadcast_to(w[:, None], [G // 32, 32]), [G])
                    else:
                        wb = tl.load((plane + p * (G // 8)).to(tl.pointer_type(tl.int32)) + (j >> 5), mask=valid,
                                     other=0)
                    idx |= ((wb >> (j & 31)) & 1) << p
            escape = (1 << K) - 1
            esc = idx == escape
            e_tab = tl.load(src + idx, mask=valid & (idx < escape), other=0).to(tl.int32)
            if MODE == 0:
                esc_i = esc.to(tl.int32)
                rank = tl.cumsum(esc_i, axis=0) - esc_i
                first = tl.load((src + starts_at).to(tl.pointer_type(tl.int32)) + g, mask=g * G < words, other=0)
                e_esc = tl.load(src + esc_at + first + rank, mask=valid & esc, other=0).to(tl.int32)
                e = tl.where(esc, e_esc, e_tab)
            else:
                e = e_tab
            word = ((s & 0x80) << 8) | (e << 7) | (s & 0x7F)
        tl.store(dst + i, word.to(tl.int16), mask=valid)


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
    ap.add_argument("--only", default=None, help="run only this variant, once (for a profiler)")
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
    variants = {"product": lambda: dec.run(src, out)}
    for warps in (2, 4, 8):
        for gpp in (1, 2, 4):
            for bcast in (0, 1):
                grid = (-(-dec.grid[0] // gpp), dec.grid[1])
                variants[f"full_w{warps}_g{gpp}_b{bcast}"] = (
                    lambda w=warps, q=gpp, b=bcast, gr=grid: _variant[gr](src, out, dec.table, G=GROUP, D=9, GPP=q,
                                                                          MODE=0, BCAST=b, num_warps=w))
    for mode in (1, 2, 3):
        variants[f"mode{mode}_w4"] = lambda m=mode: _variant[dec.grid](src, out, dec.table, G=GROUP, D=9, GPP=1,
                                                                        MODE=m, BCAST=0, num_warps=4)
    if args.only:
        variants[args.only]()
        torch.cuda.synchronize()
        return
    for name, fn in variants.items():
        out.zero_()
        try:
            fn()
            torch.cuda.synchronize()
            ok = bool(torch.equal(out, raw)) if not name.startswith("mode") else None
            t = timed(fn)
            res[name] = {"ok": ok, "s": t, "gbps_out": raw.numel() / t / 1e9}
        except Exception as exc:  # noqa: BLE001
            res[name] = {"error": str(exc)[:300]}
        print(name, res[name], flush=True)
    open(args.out, "w").write(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
