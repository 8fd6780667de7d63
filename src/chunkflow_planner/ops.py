"""The operator model: a component's compute time from its operator shapes and the GPU's measured efficiencies.

A transformer block or a text-encoder layer is a list of operators: GEMMs (M x K by K x N), attentions (query and
key lengths, heads, head dim) and memory-bound passes (norms, activations, residuals, rotary embeddings, counted in
bytes moved). Each costs

    GEMM:       2 M N K / (eta_gemm(M, N, K) P_peak)
    attention:  4 B H q k d_h / (eta_attn(q, k) P_peak)
    memory:     mem_ops_scale * bytes / hbm_gbps

with eta_gemm and eta_attn interpolated from the tables `chunkflow calibrate` measures by shape (hardware fields
`gemm_eta`, `attn_eta`, and `attn_eta_masked` for models whose attention takes a key-padding mask, which rules out
the flash kernel) and mem_ops_scale fitted to the real blocks calibrate timed. So a model calibrate never ran
is predicted from the shapes of its own operators. Without tables the scalar eta_comp applies to every FLOP.

The text encoders' operators and their price on the host CPU are the whole-pipeline extension's
(chunkflow_planner.pipeline.text, .cpu); they use the GPU side of this model as it is.

The FLOPs of a transformer block's operators add up to its F_block (flops.py, eqs. 12, 18, 22); the tests check it.
Pure Python: no torch.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:
    from chunkflow_planner.catalog import BlockGroup, HardwareSpec, ModelSpec

TFLOP = 1e12


@dataclass(frozen=True)
class Gemm:
    """count x (M x K) @ (K x N)."""

    m: float
    n: float
    k: float
    count: int = 1

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.count


@dataclass(frozen=True)
class Attention:
    """count x scaled-dot-product attention: batch x heads, q query and kv key tokens, head dim hd."""

    batch: float
    heads: float
    q: float
    kv: float
    hd: float
    count: int = 1
    masked: bool = False  # given a key-padding mask (no flash kernel)

    @property
    def flops(self) -> float:
        return 4.0 * self.batch * self.heads * self.q * self.kv * self.hd * self.count


@dataclass(frozen=True)
class MemPass:
    """Memory-bound operators moving `nbytes` through device memory."""

    nbytes: float

    @property
    def flops(self) -> float:
        return 0.0


Op = Union[Gemm, Attention, MemPass]


# ------------------------------------------------------------------------------------------ efficiencies


def _interp1(xs: list[float], x: float) -> tuple[int, int, float]:
    """Bracketing indices of x in sorted xs and the weight of the upper one, in log space, clamped."""
    if x <= xs[0]:
        return 0, 0, 0.0
    if x >= xs[-1]:
        return len(xs) - 1, len(xs) - 1, 0.0
    j = bisect.bisect_right(xs, x)
    i = j - 1
    return i, j, (math.log(x) - math.log(xs[i])) / (math.log(xs[j]) - math.log(xs[i]))


class _Grid:
    """A table on a full grid of positive coordinates, interpolated multilinearly in log space and clamped."""

    def __init__(self, rows: list[tuple[float, ...]]):
        dims = len(rows[0]) - 1
        self.axes = [sorted({r[i] for r in rows}) for i in range(dims)]
        self.values = {tuple(r[:dims]): r[dims] for r in rows}
        expected = math.prod(len(a) for a in self.axes)
        if len(self.values) != expected:
            raise ValueError(f"an efficiency table must fill its grid: {len(self.values)} of {expected} points")

    def __call__(self, *x: float) -> float:
        brackets = [_interp1(ax, v) for ax, v in zip(self.axes, x)]
        total = 0.0
        for corner in range(2 ** len(brackets)):
            weight, key = 1.0, []
            for d, (i, j, u) in enumerate(brackets):
                upper = (corner >> d) & 1
                weight *= u if upper else 1.0 - u
                key.append(self.axes[d][j if upper else i])
            if weight:
                total += weight * self.values[tuple(key)]
        return total


_GRIDS: dict[int, tuple[object, _Grid]] = {}


def efficiency_grid(table: list) -> _Grid:
    """The interpolator of a table (cached by identity; the table is kept alive with it)."""
    hit = _GRIDS.get(id(table))
    if hit is None or hit[0] is not table:
        hit = (table, _Grid([tuple(r) for r in table]))
        _GRIDS[id(table)] = hit
    return hit[1]


def eta_gemm(hw: HardwareSpec, m: float, n: float, k: float) -> float:
    """Fraction of P_peak a bf16 GEMM of this shape achieves: the measured table interpolated, else eta_comp."""
    if not hw.gemm_eta:
        return hw.eta_comp
    return efficiency_grid(hw.gemm_eta)(m, n, k)


ATTN_TABLE_HEAD_DIM = 128  # the head dim attn_eta and attn_eta_masked are measured at


def eta_attn(hw: HardwareSpec, q: float, kv: float, masked: bool = False, hd: float = ATTN_TABLE_HEAD_DIM) -> float:
    """Fraction of P_peak an attention with q query and kv key tokens achieves (table, else eta_comp); `masked`:
    given a key-padding mask (the masked table where calibrate measured one, else the unmasked one); `hd`: its head
    dim (an unmasked one takes the table of the nearest head dim measured, attn_eta_head_dims)."""
    table = hw.attn_eta_masked if masked and hw.attn_eta_masked else hw.attn_eta
    if not masked and hw.attn_eta_head_dims and hd > 0:
        dims = {ATTN_TABLE_HEAD_DIM: table, **hw.attn_eta_head_dims}
        table = dims[min(dims, key=lambda d: abs(math.log(d / hd)))] or table
    if not table:
        return hw.eta_comp
    return efficiency_grid(table)(q, kv)


def op_time(op: Op, hw: HardwareSpec) -> float:
    """Seconds of one operator on the GPU of `hw`."""
    P = hw.peak_tflops * TFLOP
    if isinstance(op, Gemm):
        return op.flops / (P * eta_gemm(hw, op.m, op.n, op.k))
    if isinstance(op, Attention):
        return op.flops / (P * eta_attn(hw, op.q, op.kv, op.masked, op.hd))
    return hw.mem_ops_scale * op.nbytes / (hw.hbm_gbps * 1e9)


def ops_time(ops: list[Op], hw: HardwareSpec) -> float:
    """Seconds of a list of operators run one after the other on the GPU; an operator repeated (every layer of a
    model runs the same shapes) is priced once, the sum taken in order."""
    once: dict[Op, float] = {}
    times = [once[op] if op in once else once.setdefault(op, op_time(op, hw)) for op in ops]
    return sum(times)


def split(ops: list[Op], hw: HardwareSpec) -> tuple[float, float]:
    """(GEMM + attention seconds, memory-pass seconds at mem_ops_scale 1): what calibrate fits the scale with."""
    flops_t = sum(op_time(op, hw) for op in ops if not isinstance(op, MemPass))
    mem_t = sum(op.nbytes / (hw.hbm_gbps * 1e9) for op in ops if isinstance(op, MemPass))
    return flops_t, mem_t


def flops(ops: list[Op]) -> float:
    return sum(op.flops for op in ops)


# ---------------------------------------------------------------------------------- transformer blocks

# Bytes moved per token by a block's memory-bound operators, as multiples of d and f (in elements of the
# activation dtype): norms and modulation, q/k norms and rotary embeddings, gates and residual adds, the MLP's
# activation. Rough by nature; calibrate's mem_ops_scale absorbs the constant.
_MEM_COEF = {
    "wan_dit": (40.0, 4.0),
    "flux_double": (30.0, 4.0),
    "hunyuan_double": (30.0, 4.0),
    "qwen_double": (30.0, 4.0),
    "flux_single": (24.0, 6.0),
    "hunyuan_single": (24.0, 6.0),
}


def block_ops(spec: ModelSpec, group: BlockGroup, batch: float, S: float, L: float, sp: int = 1) -> list[Op]:
    """The operators one GPU runs for one block of `group` (Ulysses degree `sp`: projections over S / sp tokens
    with all heads, attention over all tokens with heads / sp)."""
    d, f, H = spec.d, spec.f, spec.heads
    hd = d / H
    B = batch
    Sl = S / sp
    de = spec.dtype_bytes
    cd, cf = _MEM_COEF[group.arch]
    if group.kind == "dit":
        Ll = L / sp
        return [
            Gemm(B * Sl, d, d, 4),  # self-attention q, k, v, out
            Attention(B, H / sp, S, S, hd),
            Gemm(B * Sl, d, d, 2),  # cross-attention q, out
            Gemm(B * Ll, d, d, 2),  # cross-attention k, v of the text
            Attention(B, H / sp, S, L, hd),
            Gemm(B * Sl, f, d), Gemm(B * Sl, d, f),  # FFN
            MemPass(B * Sl * (cd * d + cf * f) * de),
        ]
    T = S + L
    Tl = T / sp
    masked = spec.diffusers.masked_attention
    if group.kind == "mmdit_double":
        return [
            Gemm(B * Sl, d, d, 4), Gemm(B * L / sp, d, d, 4),  # q, k, v, out of each stream
            Attention(B, H / sp, T, T, hd, masked=masked),
            Gemm(B * Sl, f, d), Gemm(B * Sl, d, f),  # image MLP
            Gemm(B * L / sp, f, d), Gemm(B * L / sp, d, f),  # text MLP
            MemPass(B * Tl * (cd * d + cf * f) * de),
        ]
    # single stream: linear1 (q, k, v and the MLP's up projection), attention, linear2 over [attention, MLP]
    return [
        Gemm(B * Tl, 3 * d + f, d),
        Attention(B, H / sp, T, T, hd, masked=masked),
        Gemm(B * Tl, d, d + f),
        MemPass(B * Tl * (cd * d + cf * f) * de),
    ]


def model_eta_curve(spec: ModelSpec, hw: HardwareSpec, points: int = 16) -> list[tuple[float, float]]:
    """eta_comp(F) of a model from the operator model: [F_block, eta] averaged over its blocks, for token counts
    from 256 to 256k (batch 1, SP 1); what the planner uses for a model without a measured curve of its own."""
    from chunkflow_planner.flops import F_kind

    L = spec.text_len
    P = hw.peak_tflops * TFLOP
    out = []
    for i in range(points):
        S = 256.0 * (1024.0 ** (i / (points - 1)))
        F = t = 0.0
        for g in spec.blocks:
            F += g.count * F_kind(g.kind, 1, S, L, spec.d, spec.f)
            t += g.count * ops_time(block_ops(spec, g, 1, S, L), hw)
        out.append((F / spec.n_blocks, min(1.0, F / (P * t))))
    return out
