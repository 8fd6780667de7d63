"""An uncatalogued VAE's decode priced from its operator shapes (issue 37): its decoder run on the meta device (shapes
only, no values, no time), every leaf operator's inputs and outputs and every convolution's and linear's FLOPs seen
by forward hooks, at three latent sizes; the peak and the FLOPs fitted as the catalog's measured decodes are
(catalog.VaeDecodeFit: a constant, a part per output pixel, a part per output voxel).

Two constants turn shapes into memory and time, each the bound of the catalog's VAEs measured on an H200
(tests/test_derive_folder.py recomputes them from the catalog's fits and the same meta decodes):
- LIVE_TENSORS: the measured peak allocated over the largest operator's inputs and outputs (the residuals, caches
  and the output held beside it), the largest measured by kind: 2.4 for an image VAE (FLUX's), 6.2 for a video VAE
  (Wan2.2's causal VAE; Wan2.1's 5.1, HunyuanVideo's 3-4), rounded up: a bound, the peak must not be missed;
- FLOP_RATE: the measured decodes' FLOPs a second, their median (98 to 218 TFLOP/s: Wan2.1's, FLUX's, HunyuanVideo's
  and Wan2.2's VAEs): an estimate, within a factor 1.6 of each of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

LIVE_TENSORS = {"image": 2.5, "video": 6.5}  # measured 2.38 (flux-vae) and 6.16 (wan2.2-vae at 704x1280)
FLOP_RATE = 1.4e14  # FLOP/s: the median of the measured 0.98e14 (wan2.1-vae) to 2.18e14 (wan2.2-vae), rounded down
VIDEO_LATENTS = ((11, 32, 32), (21, 32, 32), (11, 48, 48))  # (frames, height, width) of the fit's meta decodes:
# enough frames that a VAE decoding frame by frame past a length does so (HunyuanVideo's past 16 frames)
IMAGE_LATENTS = ((1, 32, 32), (1, 48, 48), (1, 64, 64))


@dataclass(frozen=True)
class MetaDecode:
    """One decode on the meta device: the output's frames, height and width, the largest leaf operator's input
    and output bytes, and the FLOPs of its convolutions and linears."""

    frames: int
    height: int
    width: int
    largest_bytes: int
    flops: float


def _nbytes(x) -> int:
    if torch.is_tensor(x):
        return x.numel() * x.element_size()
    if isinstance(x, (tuple, list)):
        return sum(_nbytes(t) for t in x)
    return 0


def _flops(m: nn.Module, out) -> float:
    if not torch.is_tensor(out):
        return 0.0
    if isinstance(m, nn.modules.conv._ConvNd):
        return 2.0 * out.numel() * (m.in_channels // m.groups) * math.prod(m.kernel_size)
    if isinstance(m, nn.Linear):
        return 2.0 * out.numel() * m.in_features
    return 0.0


def meta_decode(vae: nn.Module, latent_shape: tuple[int, ...], dtype: torch.dtype) -> MetaDecode:
    """`vae` (on the meta device) decodes zeros of `latent_shape`; what its operators hold and compute."""
    seen = {"largest": 0, "flops": 0.0}

    def hook(m, args, out):
        seen["largest"] = max(seen["largest"], _nbytes(args) + _nbytes(out))
        seen["flops"] += _flops(m, out)

    leaves = [m for m in vae.modules() if next(m.children(), None) is None]
    hooks = [m.register_forward_hook(hook) for m in leaves]
    try:
        with torch.no_grad():
            out = vae.decode(torch.zeros(latent_shape, device="meta", dtype=dtype)).sample
    finally:
        for h in hooks:
            h.remove()
    frames = out.shape[2] if out.dim() == 5 else 1
    return MetaDecode(frames, out.shape[-2], out.shape[-1], seen["largest"], seen["flops"])


def _fit(points: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """(const, per_px, per_voxel) through three (px, voxels, value) points (solved exactly; negative parts kept at
    zero, the constant taking up the rest at the largest point)."""
    (p1, v1, y1), (p2, v2, y2), (p3, v3, y3) = points
    det = (p2 - p1) * (v3 - v1) - (p3 - p1) * (v2 - v1)
    if det == 0:
        per_vox = max(0.0, (y3 - y1) / (v3 - v1)) if v3 != v1 else 0.0
        return max(0.0, y1 - per_vox * v1), 0.0, per_vox
    per_px = ((y2 - y1) * (v3 - v1) - (y3 - y1) * (v2 - v1)) / det
    per_vox = ((p2 - p1) * (y3 - y1) - (p3 - p1) * (y2 - y1)) / det
    per_px, per_vox = max(0.0, per_px), max(0.0, per_vox)
    const = max(0.0, max(y - per_px * p - per_vox * v for p, v, y in points))
    return const, per_px, per_vox


def decode_fit(vae: nn.Module, latent_channels: int, video: bool, dtype: torch.dtype) -> dict:
    """A VaeDecodeFit (as a dict) for `vae` on the meta device: peak memory LIVE_TENSORS x its largest operator's
    bytes, time its FLOPs at FLOP_RATE, each fitted over three latent sizes."""
    runs = [meta_decode(vae, (1, latent_channels, f, h, w) if video else (1, latent_channels, h, w), dtype)
            for f, h, w in (VIDEO_LATENTS if video else IMAGE_LATENTS)]
    live = LIVE_TENSORS["video" if video else "image"]
    mem = _fit([(r.height * r.width, r.frames * r.height * r.width, live * r.largest_bytes) for r in runs])
    per_voxel_s = max(r.flops / (r.frames * r.height * r.width) for r in runs) / FLOP_RATE  # the most per voxel
    return dict(mem_const=mem[0], mem_per_px=mem[1], mem_per_voxel=mem[2], time_const=0.0,
                time_per_voxel=per_voxel_s, time_per_call=0.0,
                source=f"derived from its operator shapes on the meta device: peak {live} x the largest "
                       f"operator's bytes, time its FLOPs at {FLOP_RATE / 1e12:.0f} TFLOP/s (models/vae_shapes.py)")
