"""GGUF files for tests, written with the gguf package as city96's and QuantStack's converters write them: the
original (non-diffusers) key names, the 2-D weights in the chosen ggml type, 1-D tensors (norms, biases) in F32.

Q8_0, Q4_0 (and F16, BF16) are quantized by gguf-py; it cannot quantize the K types, so their blocks are random
bytes with finite fp16 scale fields (valid blocks: every dequantized value finite)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

Q = gguf.GGMLQuantizationType

# K type -> byte ranges of each block's fp16 scale fields (d, dmin): set to small finite values
_K_SCALES = {Q.Q4_K: [(0, 2), (2, 4)], Q.Q5_K: [(0, 2), (2, 4)], Q.Q6_K: [(208, 210)]}


def quantized(values: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """`values` (float32, 2-D) stored as `qtype`: the uint8 block bytes (K types: valid random blocks)."""
    if qtype in (Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.BF16, Q.Q4_1, Q.Q5_0, Q.Q5_1):
        return gguf.quants.quantize(values.astype(np.float32), qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = values.shape
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for lo, hi in _K_SCALES[qtype]:
        scale = (rng.random((rows, cols // block)) * 0.01 + 0.001).astype(np.float16)
        raw[:, :, lo:hi] = scale.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, cols // block * size)


def write_gguf(path: Path, tensors: dict[str, torch.Tensor], qtype: Q, arch: str = "flux", seed: int = 0) -> Path:
    """Write `tensors` (original key names) to a GGUF file: tensors of 2+ dims whose rows fit `qtype`'s blocks in
    that type, the rest (1-D tensors, odd rows) in F32."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    for name, t in tensors.items():
        a = t.detach().float().numpy()
        if a.ndim >= 2 and a.shape[-1] % block == 0 and qtype != Q.F32:
            flat = a.reshape(-1, a.shape[-1])
            q = quantized(flat, qtype, rng)
            q = q.reshape(*a.shape[:-1], q.shape[-1])
            w.add_tensor(name, q, raw_dtype=qtype if q.dtype == np.uint8 else None)
        else:
            w.add_tensor(name, a.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
