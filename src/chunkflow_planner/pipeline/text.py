"""The text encoders: their operators, and the seconds and bytes of one in each placement.

A text encoder's forward runs a few hundred tokens through many small layers: its host work can outlast its device
work, so on the GPU it takes the longer of the two, the host work being its layers at the host cost of one as
calibrate times it per architecture (`text_layer_host_us`, scaled by the reports' `host_margin`). On the host CPU
(placement `cpu`) its operators run at the CPU's measured rates (cpu.py), plus the same host dispatch.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from chunkflow_planner.ops import Attention, Gemm, MemPass, Op, ops_time
from chunkflow_planner.overlap import GB
from chunkflow_planner.pipeline.cpu import ops_time_cpu
from chunkflow_planner.pipeline.placement import ON_DISK, TEXT_PLACEMENTS
from chunkflow_planner.tiers import disk_known, read_s

if TYPE_CHECKING:
    from chunkflow_planner.catalog import HardwareSpec, ModelSpec, Workload
    from chunkflow_planner.components import TextEncoderSpec

TEXT_STREAM_CHUNK = 16 * 10**6
TEXT_DISK_RING = 2  # a text encoder on disk reads its layers into a page-locked ring of two of its largest

TextCosts = dict[tuple[int, str], tuple[float, float, float, float]]


def text_encoder_ops(te: TextEncoderSpec, batch: float, tokens: float) -> list[Op]:
    """The operators of one forward of a text encoder's layers over `tokens` tokens (embeddings and heads are
    lookups; the vision tower of a VL encoder does not run for a text prompt)."""
    a = te.shape()
    d, ff, H, hd, kv = a["d"], a["ff"], a["heads"], a["head_dim"], a["kv_heads"]
    M = batch * tokens
    inner = H * hd
    kv_inner = kv * hd
    mlp = [Gemm(M, ff, d, 2 if a["gated"] else 1), Gemm(M, d, ff)]
    layer = [
        Gemm(M, inner, d), Gemm(M, kv_inner, d, 2), Gemm(M, d, inner),  # q, k, v, out
        Attention(batch, H, tokens, tokens, hd),
        *mlp,
        MemPass(M * (20 * d + 6 * ff) * te.dtype_bytes + (3 * batch * H * tokens * tokens * 4 if a["eager_attention"] else 0)),
    ]
    return layer * a["layers"]


def text_act_bytes(te: TextEncoderSpec) -> float:
    """Peak activation bytes of one text-encoder forward (hidden states, MLP, materialised attention scores)."""
    a = te.shape()
    n = te.tokens
    act = n * (6 * a["d"] + 2 * a["ff"]) * te.dtype_bytes
    if a["eager_attention"]:
        act += 2 * a["heads"] * n * n * 4
    return act * te.margin


def text_device_s(te: TextEncoderSpec, hw: HardwareSpec) -> float:
    """Seconds one forward of a text encoder keeps the GPU busy: its operators' device time (ops.py)."""
    return ops_time(text_encoder_ops(te, 1, te.tokens), hw) * te.margin


def layer_host_us(te: TextEncoderSpec, hw: HardwareSpec) -> float:
    """Host microseconds of one layer's dispatch: calibrate's for its architecture; for an architecture calibrate
    never timed (`other`, a derived entry's), the dearest one it timed, times the encoder's margin."""
    table = hw.pipeline.text_layer_host_us
    if te.arch in table:
        return table[te.arch]
    return max(table.values(), default=0.0) * te.margin if te.arch == "other" else 0.0


def text_host_s(te: TextEncoderSpec, hw: HardwareSpec) -> float:
    """Host seconds one eager forward of a text encoder dispatches in a generation: its layers at the host cost of
    one as calibrate timed it for its architecture (PipelineProfile.text_layer_host_us; 0 where unmeasured), times the
    reports' host_margin."""
    return te.shape()["layers"] * layer_host_us(te, hw) * 1e-6 * hw.pipeline.host_margin


def text_forward_s(te: TextEncoderSpec, hw: HardwareSpec, on_cpu: bool = False) -> float:
    """Seconds of one forward of a text encoder: on the GPU the longer of its device time and its host dispatch,
    on the CPU its operators' time at the CPU's measured rates plus that dispatch (text_host_s, ops.py)."""
    if on_cpu:
        return ops_time_cpu(text_encoder_ops(te, 1, te.tokens), hw) * te.margin + text_host_s(te, hw)
    return max(text_device_s(te, hw), text_host_s(te, hw))


def _text_cost(te: TextEncoderSpec, placement: str, passes: int,
               hw: HardwareSpec) -> tuple[float, float, float, float]:
    """(seconds, device bytes while it runs, host bytes, the share of those seconds spent moving its parked part to
    the device) of one text encoder in its placement."""
    bw = hw.h2d_gbps * GB
    if placement == "cpu":
        return passes * text_forward_s(te, hw, on_cpu=True), 0.0, float(te.nbytes), 0.0
    t_fwd = text_forward_s(te, hw)
    act = text_act_bytes(te)
    if placement == "gpu":
        return passes * t_fwd, te.nbytes + act, 0.0, 0.0
    if placement == "phase":
        return passes * t_fwd + te.nbytes / bw, te.nbytes + act, float(te.nbytes), te.nbytes / bw
    # stream: each layer waits for the longer of its compute and its transfer; non-layer tensors come back once.
    # disk: the same, each layer read from the files at each use (a ring of two layers in host memory) and the
    # non-layer tensors read from the files once a phase (tiers.py)
    layers = te.shape()["layers"]
    layer_bytes = te.layer_params * te.dtype_bytes
    rest = te.nbytes - layers * layer_bytes
    t_layer = t_fwd / layers
    copy = layer_bytes / bw + math.ceil(layer_bytes / TEXT_STREAM_CHUNK) * hw.dma_startup_us * 1e-6
    if placement == "disk":
        per_fwd = layers * max(t_layer, read_s(layer_bytes, "disk", hw), copy)
        move = read_s(rest, "disk", hw)
        return passes * per_fwd + move, rest + 2 * layer_bytes + act, TEXT_DISK_RING * layer_bytes, move
    per_fwd = layers * max(t_layer, copy)
    return passes * per_fwd + rest / bw, rest + 2 * layer_bytes + act, float(te.nbytes), rest / bw


def text_costs(spec: ModelSpec, w: Workload, hw: HardwareSpec) -> TextCosts:
    """(seconds, device bytes, host bytes, seconds moving to the device) of every text encoder in every placement
    (on disk only where the disk's rate is known): (index, placement) -> cost."""
    places = [p for p in TEXT_PLACEMENTS if p != ON_DISK or disk_known(hw)]
    return {(i, p): _text_cost(te, p, w.cfg_passes, hw)
            for i, te in enumerate(spec.pipeline.text_encoders) for p in places}
