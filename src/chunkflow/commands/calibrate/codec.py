"""The lossless codec's two figures (issue 39), as the planner prices it (chunkflow_planner/tiers.py):
- its ratio rho on the user's weights: the transformer's streamed (block) tensors read from the checkpoint's
  safetensors, a bounded sample spread over them in chunks, each encoded on the CPU as the host store encodes it;
  stored / raw bytes (HardwareSpec.codec_ratio);
- its decode rate D on this GPU: one 64 MiB chunk of those weights (or of random normal bf16 where no weights are
  given) encoded, then decoded by the Triton kernel, timed with CUDA events, the median of repeats
  (HardwareSpec.codec_decode_gbps, GB/s of decoded output).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Callable

SAMPLE_BYTES = 256 * 2**20  # at most this much of the weights is encoded for the ratio
CHUNK_BYTES = 16 * 2**20  # as the runtime encodes: a chunk at a time (the paper's operating point, in MiB)
DECODE_BYTES = 64 * 2**20  # the decode rate's sample
DECODE_REPEATS = 20
SIXTEEN_BIT = ("BF16", "F16")  # the codec's words: what exponent-pack shrinks


def transformer_files(folder: Path) -> list[Path]:
    """The transformer's safetensors files of a pipeline folder (its transformer/ folder), or of a transformer folder
    itself; only regular files inside it (a link leaving the folder is not read)."""
    root = folder / "transformer" if (folder / "transformer").is_dir() else folder
    inside = root.resolve()
    out = []
    for path in sorted(root.glob("*.safetensors")):
        real = path.resolve()
        if real.is_file() and (real.parent == inside or _in_hub_blobs(real, inside)):
            out.append(path)
    return out


def _in_hub_blobs(real: Path, inside: Path) -> bool:
    """Whether `real` is a blob of the Hub cache repo whose snapshot `inside` is (snapshot files link there)."""
    for parent in inside.parents:
        if parent.name == "snapshots":
            return real.parent == parent.parent / "blobs"
    return False


def streamed_tensors(files: list[Path]) -> list[tuple[Path, str, int]]:
    """(file, name, bytes) of the 16-bit tensors of the transformer's blocks (the streamed ones: a name with
    "blocks."), else of every 16-bit tensor where no name says block; in file and name order."""
    from safetensors import safe_open

    found = []
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                if sl.get_dtype() in SIXTEEN_BIT:
                    n = 1
                    for d in sl.get_shape():
                        n *= d
                    found.append((path, name, 2 * n))
    blocks = [t for t in found if "blocks." in t[1]]
    return blocks or found


def sample_chunks(tensors: list[tuple[Path, str, int]], sample_bytes: int = SAMPLE_BYTES,
                  chunk_bytes: int = CHUNK_BYTES):
    """Up to `sample_bytes` of the tensors as flat uint8 chunks of at most `chunk_bytes`, one from each of tensors
    spread evenly over the list (the first chunk of each: a tensor's bytes are alike along it)."""
    import torch
    from safetensors import safe_open

    if not tensors:
        return
    per = max(1, min(len(tensors), sample_bytes // max(1, min(chunk_bytes, max(t[2] for t in tensors)))))
    picked = [tensors[int(i * len(tensors) / per)] for i in range(per)]
    taken = 0
    for path, name, nbytes in picked:
        if taken >= sample_bytes:
            return
        with safe_open(str(path), framework="pt") as f:
            t = f.get_tensor(name)
        flat = t.contiguous().view(-1).view(torch.uint8)[: min(chunk_bytes, sample_bytes - taken)]
        taken += flat.numel()
        yield flat.clone()


def measure_ratio(folder: Path, sample_bytes: int = SAMPLE_BYTES, chunk_bytes: int = CHUNK_BYTES) -> dict | None:
    """rho on `folder`'s transformer: {ratio, raw_bytes, stored_bytes, chunks, tensors}; None where it has no 16-bit
    tensors to sample."""
    from chunkflow.runtime.codecs.exponent_pack import encode

    tensors = streamed_tensors(transformer_files(folder))
    raw = stored = chunks = 0
    for chunk in sample_chunks(tensors, sample_bytes, chunk_bytes):
        raw += chunk.numel()
        stored += encode(chunk).stored
        chunks += 1
    if raw == 0:
        return None
    return dict(ratio=stored / raw, raw_bytes=raw, stored_bytes=stored, chunks=chunks, tensors=len(tensors))


def measure_decode(device, chunk=None, nbytes: int = DECODE_BYTES, repeats: int = DECODE_REPEATS) -> dict | None:
    """D on `device` (CUDA with Triton; else None): `chunk` (flat uint8, e.g. the user's weights) tiled to `nbytes`,
    or random normal bf16, encoded on the device and decoded in the launch shape the runtime would time fastest
    (Decode.tune), each decode timed with CUDA events; {gbps (decoded bytes per second / 1e9, the median's), median_s,
    nbytes, k, ratio, config, times_s (each repeat)}."""
    import torch

    from chunkflow.runtime.codecs import exponent_pack_gpu
    from chunkflow.runtime.codecs.exponent_pack import encode

    if device.type != "cuda" or not exponent_pack_gpu.available():
        return None
    if chunk is None or chunk.numel() < 2:
        g = torch.Generator(device="cpu").manual_seed(0)
        chunk = torch.randn(nbytes // 2, generator=g, dtype=torch.float32).to(torch.bfloat16).view(torch.uint8)
    reps = -(-nbytes // chunk.numel())
    data = chunk.repeat(reps)[:nbytes].to(device)
    enc = encode(data)
    out = torch.empty(nbytes, dtype=torch.uint8, device=device)
    decode = exponent_pack_gpu.Decode([exponent_pack_gpu.Chunk(0, 0, enc.nbytes, enc.k, enc.n_escapes)], device)
    out.zero_()
    config = decode.tune(enc.data, out)  # builds the kernel's shapes, keeps the fastest (as the encoded tier does)
    torch.cuda.synchronize(device)
    if not torch.equal(out, data):
        raise RuntimeError("the codec's GPU decoder did not give back the bytes encoded: its rate is not measured")
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        decode.run(enc.data, out, config)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    median = statistics.median(times)
    return dict(gbps=nbytes / median / 1e9, median_s=median, nbytes=nbytes, k=enc.k, ratio=enc.stored / nbytes,
                config=list(config), times_s=times)


def measure_codec(weights: str | None, device, log: Callable[[str], None]) -> tuple[dict, dict]:
    """(profile fields, raw rows): codec_ratio where `weights` (a folder or Hub id in the local cache) has a
    transformer with 16-bit tensors, codec_decode_gbps on CUDA with Triton (on those weights where sampled)."""
    import torch

    extra: dict = {}
    raw: dict = {}
    sample = None
    if weights is not None:
        from chunkflow.commands.calibrate.disk import disk_folder

        folder = disk_folder(weights)[0]
        ratio = measure_ratio(folder)
        if ratio is None:
            log(f"codec: no 16-bit transformer tensors in {folder} to sample; the ratio stays supposed")
        else:
            extra["codec_ratio"] = round(min(1.0, ratio["ratio"]), 4)
            raw["ratio"] = ratio
            log(f"codec exponent-pack: {ratio['stored_bytes'] / 2**20:.1f} MiB stored of {ratio['raw_bytes'] / 2**20:.1f} "
                f"MiB of the transformer's weights ({ratio['chunks']} chunks of {ratio['tensors']} tensors): ratio "
                f"{ratio['ratio']:.3f}")
            chunks = list(sample_chunks(streamed_tensors(transformer_files(folder)), DECODE_BYTES))
            sample = torch.cat(chunks) if chunks else None
    try:
        dec = measure_decode(device, sample)
    except (RuntimeError, ValueError) as exc:  # a Triton that cannot build the kernel here
        log(f"codec decode rate not measured: {exc}")
        dec = None
    if dec is not None:
        extra["codec_decode_gbps"] = round(dec["gbps"], 1)
        raw["decode"] = dec
        log(f"codec exponent-pack: decodes {dec['nbytes'] / 2**20:.0f} MiB in {dec['median_s'] * 1e3:.3f} ms "
            f"({dec['gbps']:.0f} GB/s of output, K={dec['k']})")
    elif device.type == "cuda":
        log("codec decode rate not measured: Triton is not available here (the codec is not planned without it)")
    return extra, raw
