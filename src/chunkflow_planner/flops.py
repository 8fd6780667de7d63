"""Per-block FLOPs of DiT and MM-DiT blocks (ChunkFlow paper, Appendix B, eqs. 7-23).

Notation as in the paper: B batch, S image/video tokens, L text context length (L_ctx), d hidden size,
f FFN inner size. Every F_* here is the global FLOP count of one block; under Ulysses SP (or TP) of
degree N each GPU performs 1/N of it (the head dimension is partitioned), see `F_block_per_gpu`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the catalog prices its models with these formulas
    from chunkflow_planner.catalog import BlockKind, ModelSpec


# --- DiT block (WanVideo): self-attention, cross-attention to the text, MLP -------------------------

def F_self_proj(B: float, S: float, d: float) -> float:
    """Eq. 7: QKV and output projections of self-attention, 8 B S d^2."""
    return 8 * B * S * d**2


def F_self_attn(B: float, S: float, d: float) -> float:
    """Eq. 8: self-attention scores and weighted sum, 4 B S^2 d."""
    return 4 * B * S**2 * d


def F_cross_proj(B: float, S: float, L: float, d: float) -> float:
    """Eq. 9: cross-attention query and output (4 B S d^2) plus text key/value (4 B L d^2)."""
    return 4 * B * S * d**2 + 4 * B * L * d**2


def F_cross_attn(B: float, S: float, L: float, d: float) -> float:
    """Eq. 10: video-to-text attention, 4 B S L d."""
    return 4 * B * S * L * d


def F_mlp(B: float, S: float, d: float, f: float) -> float:
    """Eq. 11: the two FFN matmuls, 4 B S d f."""
    return 4 * B * S * d * f


def F_dit(B: float, S: float, L: float, d: float, f: float) -> float:
    """Eq. 12: F_block of a DiT block, the sum of eqs. 7-11."""
    return F_self_proj(B, S, d) + F_self_attn(B, S, d) + F_cross_proj(B, S, L, d) + F_cross_attn(B, S, L, d) + F_mlp(B, S, d, f)


# --- MM-DiT double-stream block (Flux transformer_blocks, Hunyuan double blocks, Qwen-Image) --------

def F_dbl(B: float, S: float, L: float, d: float, f: float) -> float:
    """Eq. 18: double-stream block = eqs. 13 (8BSd^2) + 14 (8BLd^2) + 15 (4B(S+L)^2 d) + 16 (4BSdf) + 17 (4BLdf)."""
    img_proj = 8 * B * S * d**2
    txt_proj = 8 * B * L * d**2
    joint_attn = 4 * B * (S + L) ** 2 * d
    img_mlp = 4 * B * S * d * f
    txt_mlp = 4 * B * L * d * f
    return img_proj + txt_proj + joint_attn + img_mlp + txt_mlp


# --- MM-DiT single-stream block (Flux single_transformer_blocks, Hunyuan single blocks) -------------

def F_sng(B: float, S: float, L: float, d: float, f: float) -> float:
    """Eq. 22: single-stream block = eqs. 19 (linear1) + 20 (attention) + 21 (linear2) over S + L tokens."""
    T = S + L
    lin1 = 2 * B * T * d * (3 * d + f)
    attn = 4 * B * T**2 * d
    lin2 = 2 * B * T * (d + f) * d
    return lin1 + attn + lin2


def F_kind(kind: BlockKind, B: float, S: float, L: float, d: float, f: float) -> float:
    """Global FLOPs of one block of the given family."""
    if kind == "dit":
        return F_dit(B, S, L, d, f)
    if kind == "mmdit_double":
        return F_dbl(B, S, L, d, f)
    if kind == "mmdit_single":
        return F_sng(B, S, L, d, f)
    raise ValueError(f"unknown block kind {kind!r}")


def F_block_avg(spec: ModelSpec, B: float, S: float, L: float | None = None) -> float:
    """Eq. 23: the block-averaged global F_block, (sum_g N_g F_g) / (sum_g N_g); eq. 12 for a DiT model."""
    L = spec.text_len if L is None else L
    total = sum(g.count * F_kind(g.kind, B, S, L, spec.d, spec.f) for g in spec.blocks)
    return total / spec.n_blocks


def F_block_per_gpu(spec: ModelSpec, B: float, S: float, sp: int = 1, L: float | None = None) -> float:
    """Per-GPU F_block under Ulysses SP (or TP) of degree `sp`: eq. 23 divided by the degree (App. B, C)."""
    return F_block_avg(spec, B, S, L) / sp
