"""The exponent-Huffman codec on a GPU (issue 39's first measurement): chunks of bf16 encoded by the CPU reference
and by the torch encoder on the GPU (the same bytes, checked), copied to the device from pinned memory raw and
encoded, decoded by the Triton kernel; checks every decoded byte against the chunk and times (CUDA events, median
of REPEAT) the raw copy, the encoded copy and the decode. Writes JSON to the path given.

    python scripts/codec_bench.py OUT.json [--chunks 4] [--chunk-mb 16] [--std 0.02]

The values are random normal bf16 (no trained checkpoint reaches the GPU machine): their exponents are distributed
as trained weights' roughly are, but the ratio on a real checkpoint must be measured on it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from chunkflow.runtime.codecs.exponent_huffman import encode
from chunkflow.runtime.codecs.exponent_huffman_gpu import decode_into, encode_on, tables

REPEAT = 20


def timed(fn) -> float:
    """Median seconds of `fn` on the current stream."""
    times = []
    for _ in range(REPEAT):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--chunk-mb", type=int, default=16)
    ap.add_argument("--std", type=float, default=0.02)
    a = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    rows = []
    for c in range(a.chunks):
        x = (torch.randn(a.chunk_mb * 2**20 // 2, generator=g) * a.std).to(torch.bfloat16)
        raw = x.view(torch.uint8)
        t0 = time.perf_counter()
        enc = encode(raw.numpy())
        enc_s = time.perf_counter() - t0
        on_gpu = raw.to(dev)
        encode_on(on_gpu)  # the first run builds the kernels
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        enc_gpu = encode_on(on_gpu)
        enc_gpu_s = time.perf_counter() - t0
        same_encoding = bool((enc_gpu.data == enc.data).all()) if enc_gpu.data.size == enc.data.size else False
        host_raw = raw.pin_memory()
        host_enc = torch.from_numpy(enc.data.copy()).pin_memory()
        dev_raw = torch.empty_like(host_raw, device=dev)
        dev_enc = torch.empty_like(host_enc, device=dev)
        out = torch.empty(enc.nbytes, dtype=torch.uint8, device=dev)
        table = tables(enc, dev)
        dev_enc.copy_(host_enc)
        decode_into(out, dev_enc, enc, table)  # the first launch compiles
        torch.cuda.synchronize()
        exact = bool(torch.equal(out.cpu(), raw))
        copy_raw = timed(lambda: dev_raw.copy_(host_raw, non_blocking=True))
        copy_enc = timed(lambda: dev_enc.copy_(host_enc, non_blocking=True))
        dec = timed(lambda: decode_into(out, dev_enc, enc, table))
        rows.append(dict(chunk=c, bytes=enc.nbytes, encoded_bytes=int(enc.data.size), ratio=enc.ratio, exact=exact,
                         encode_cpu_s=enc_s, encode_gpu_s=enc_gpu_s,
                         gpu_encoding_is_the_reference=same_encoding, copy_raw_s=copy_raw, copy_encoded_s=copy_enc, decode_s=dec,
                         h2d_gbps=enc.nbytes / copy_raw / 1e9, decode_gbps=enc.nbytes / dec / 1e9,
                         segments=enc.segments, max_code_bits=int(enc.lengths.max())))
        print(json.dumps(rows[-1]), flush=True)
    summary = dict(gpu=torch.cuda.get_device_name(dev), torch=torch.__version__, std=a.std, chunk_mb=a.chunk_mb,
                   values="random normal bf16", rows=rows,
                   ratio=statistics.median(r["ratio"] for r in rows),
                   decode_gbps=statistics.median(r["decode_gbps"] for r in rows),
                   h2d_gbps=statistics.median(r["h2d_gbps"] for r in rows),
                   all_exact=all(r["exact"] for r in rows))
    with open(a.out, "w") as f:
        json.dump(summary, f, indent=2)
    print({k: v for k, v in summary.items() if k != "rows"})


if __name__ == "__main__":
    main()
