"""Stored weight formats (issue 52): the files users download, priced per block before the download.

A stored format keeps a block's 2-D linear weights quantized and everything else as it is, as city96's GGUF files
(tools/convert.py and its llama.cpp patch in city96/ComfyUI-GGUF) and Comfy's fp8-scaled safetensors files do:

    format       a weight's bytes                              the rest of a block       bits a weight
    bf16         2                                             as the model holds it     16
    q8_0         34 bytes a block of 32 (fp16 scale, 32 int8)  F32                       8.5
    q6_k         210 bytes a block of 256                      F32                       6.5625
    q5_k         176 bytes a block of 256                      F32                       5.5
    q4_k         144 bytes a block of 256                      F32                       4.5
    q4_0         18 bytes a block of 32 (fp16 scale, 32 x 4b)  F32                       4.5
    fp8-scaled   1 (float8_e4m3fn) + one fp32 scale a weight   bf16 (float32 where the   8 (+ 32 a tensor)
                 tensor (`scale_weight`)                       class keeps float32)

A GGUF weight whose rows (its input size) do not split into whole quant blocks is kept in F16, as city96's llama.cpp
patch does. Non-block tensors are estimated in the model's own dtype (an upper bound: the files quantize some of
them); a file's header gives every tensor exactly (stored_file.py).

The runtime streams the stored bytes and each layer dequantizes its weight in its own forward, on the GPU (diffusers'
GGUFLinear; a ScaledFp8Linear), once per call: a block's compute grows by its decoded bytes / the format's decode
rate (HardwareSpec.format_decode_gbps, which `chunkflow calibrate` measures; SUPPOSED_DECODE_SHARE of the memory
bandwidth until it has), all-on-GPU alike, and the GPU holds, besides the stored bytes, one dequantized weight at a
time (the block's largest, in the compute dtype).

Pure Python: no torch import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from chunkflow_planner.errors import ChunkflowError

if TYPE_CHECKING:
    from chunkflow_planner.catalog import BlockGroup, HardwareSpec, ModelSpec, StoredBlock

COMPUTE_BYTES = 2  # a dequantized weight in the compute dtype (bf16)
F16_BYTES = 2  # city96's fallback for a GGUF weight whose rows do not split into quant blocks


class FormatError(ChunkflowError):
    """A format name or file chunkflow cannot price; the message says what to give instead."""


@dataclass(frozen=True)
class WeightFormat:
    """How a format stores one block's tensors: its quantized weights `block_bytes` per `block_weights`, a
    `scale_bytes` scale per quantized tensor, the tensors it keeps at `kept_bytes` an element."""

    name: str
    block_weights: int
    block_bytes: int
    kept_bytes: int
    scale_bytes: int = 0
    gguf_type: str | None = None
    about: str = ""

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / self.block_weights

    @property
    def quantized(self) -> bool:
        return self.name != "bf16"


FORMATS: dict[str, WeightFormat] = {f.name: f for f in (
    WeightFormat("bf16", 1, 2, 2, about="the model's own dtype: the diffusers folder"),
    WeightFormat("q8_0", 32, 34, 4, gguf_type="Q8_0", about="GGUF Q8_0"),
    WeightFormat("q6_k", 256, 210, 4, gguf_type="Q6_K", about="GGUF Q6_K"),
    WeightFormat("q5_k", 256, 176, 4, gguf_type="Q5_K", about="GGUF Q5_K (Q5_K_S; a Q5_K_M file mixes in Q6_K)"),
    WeightFormat("q4_k", 256, 144, 4, gguf_type="Q4_K", about="GGUF Q4_K (Q4_K_S; a Q4_K_M file mixes in Q6_K)"),
    WeightFormat("q4_0", 32, 18, 4, gguf_type="Q4_0", about="GGUF Q4_0"),
    WeightFormat("fp8-scaled", 1, 1, 2, scale_bytes=4, about="float8_e4m3fn weights with a per-tensor scale_weight "
                 "(Comfy's fp8_scaled safetensors)"),
)}
FORMAT_NAMES = tuple(FORMATS)
GGUF_FORMATS = {f.gguf_type: f.name for f in FORMATS.values() if f.gguf_type is not None}
GGUF_KEPT_TYPES = ("F32", "F16", "BF16")  # unquantized GGUF types: no decode
# GGUF quant types files carry that chunkflow does not run (diffusers dequantizes some of them): named in the error
GGUF_UNSUPPORTED = ("Q4_1", "Q5_0", "Q5_1", "Q8_1", "Q2_K", "Q3_K", "Q8_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS",
                    "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4")

# Supposed decode rates, as a share of the GPU's memory bandwidth (HardwareSpec.hbm_gbps), until `chunkflow
# calibrate` measures them: diffusers' dequantization is a chain of elementwise torch kernels, each a pass over the
# weight. fp8-scaled is two passes (cast, scale: about 7 bytes moved per 2 out, 0.28 of the bandwidth); Q8_0 a few
# more; Q4_0 unpacks nibbles; the K-quants unpack 6-bit scales too. Their order is what the CPU measured of
# diffusers' functions (2026-12, this repository's CI machine: Q8_0 = Q4_0 = 1, Q6_K 0.5, Q5_K 0.37, Q4_K 0.24, fp8
# 1.2 of Q8_0's rate); the shares are set below the elementwise bound on purpose: supposed, and conservative.
SUPPOSED_DECODE_SHARE: dict[str, float] = {"fp8-scaled": 0.20, "q8_0": 0.10, "q4_0": 0.08, "q6_k": 0.05,
                                           "q5_k": 0.035, "q4_k": 0.025}


def parse_formats(text: str) -> list[str]:
    """The formats of `--format a,b,c`, each once in the order given; an unknown name is one line naming the valid
    ones."""
    names = [n.strip().lower() for n in str(text).split(",")]
    if not names or any(not n for n in names):
        raise FormatError(f"--format {text!r} names no format; give one or more of {', '.join(FORMAT_NAMES)}, "
                          "comma-separated")
    # a _M file's name prices as its main type (it mixes in Q6_K: a few percent more, said in the table's notes)
    aliases = {"fp8": "fp8-scaled", "fp8_scaled": "fp8-scaled", "q5_k_s": "q5_k", "q4_k_s": "q4_k", "q5_k_m": "q5_k",
               "q4_k_m": "q4_k"}
    out: list[str] = []
    for n in names:
        n = aliases.get(n, n)
        if n not in FORMATS:
            known = n.upper() in GGUF_UNSUPPORTED or n.upper().rsplit("_", 1)[0] in GGUF_UNSUPPORTED
            why = "a GGUF type chunkflow does not run" if known else "not a format chunkflow knows"
            raise FormatError(f"--format {n!r} is {why}; give one or more of {', '.join(FORMAT_NAMES)}, "
                              "comma-separated")
        if n not in out:
            out.append(n)
    return out


def weight_bytes(fmt: WeightFormat, out_features: int, in_features: int) -> tuple[int, int]:
    """(bytes stored, bytes decoded each call) of one (out, in) linear weight in `fmt`: whole quant blocks along its
    rows (a GGUF weight whose rows do not split into them kept in F16, decoded 0), plus its scale."""
    n = out_features * in_features
    if fmt.gguf_type is not None and in_features % fmt.block_weights:
        return n * F16_BYTES, 0
    return n // fmt.block_weights * fmt.block_bytes + fmt.scale_bytes, n * COMPUTE_BYTES


def estimate_block(spec: ModelSpec, group: BlockGroup, fmt: WeightFormat) -> StoredBlock:
    """One block of `group` in `fmt`, from its layout (params.linear_shapes): its 2-D weights quantized, the rest at
    the format's kept bytes (float32 for what the class keeps in float32: GGUF's F32 is that already)."""
    from chunkflow_planner.catalog import StoredBlock
    from chunkflow_planner.params import linear_shapes

    if group.params is not None:
        raise FormatError(f"{spec.name}'s {group.diffusers_list} blocks were measured from a folder, and chunkflow "
                          "knows no layer layout for them to price a stored format from; plan the file itself "
                          "(--transformer FILE)")
    shapes = linear_shapes(group.arch, spec)
    stored = decoded = 0
    for out_f, in_f in shapes:
        s, d = weight_bytes(fmt, out_f, in_f)
        stored, decoded = stored + s, decoded + d
    rest = spec.block_params(group) - sum(o * i for o, i in shapes)
    fp32 = spec.block_fp32_params(group)
    stored += (rest - fp32) * fmt.kept_bytes + 4 * fp32
    peak = max((o * i * COMPUTE_BYTES for o, i in shapes if weight_bytes(fmt, o, i)[1]), default=0)
    return StoredBlock(nbytes=stored, decoded={fmt.name: decoded} if decoded else {}, dequant_peak_bytes=peak)


def with_format(spec: ModelSpec, name: str) -> ModelSpec:
    """`spec` with its weights in format `name`, estimated from the format's bits per weight (before any download):
    `spec` itself for bf16."""
    if name not in FORMATS:
        raise FormatError(f"unknown format {name!r}; one of {', '.join(FORMAT_NAMES)}")
    fmt = FORMATS[name]
    if not fmt.quantized or spec.stored is not None and spec.stored.format == name:
        return spec
    if spec.stored is not None:
        raise FormatError(f"{spec.name} is planned from a {spec.stored.format} file ({spec.stored.source}); "
                          f"--format {name} prices a format before its download: give one or the other")
    from chunkflow_planner.catalog import StoredWeights

    blocks = [estimate_block(spec, g, fmt) for g in spec.blocks]
    groups = [g.model_copy(update={"stored": b}) for g, b in zip(spec.blocks, blocks)]
    block_total = sum(b.nbytes * g.count for b, g in zip(blocks, spec.blocks))
    stored = StoredWeights(format=name, source=f"estimated before the download: {fmt.bits_per_weight:g} bits a block "
                           "weight", nbytes=block_total + spec.non_block_bytes,
                           bf16_block_bytes=spec.block_bytes_total,
                           types={fmt.gguf_type or "F8_E4M3": sum(_quantized_weights(spec, g, fmt) * g.count
                                                                  for g in spec.blocks)})
    return spec.model_copy(update={"blocks": groups, "stored": stored})


def _shapes(spec: ModelSpec, group: BlockGroup) -> list[tuple[int, int]]:
    from chunkflow_planner.params import linear_shapes

    return linear_shapes(group.arch, spec)


def _quantized_weights(spec: ModelSpec, group: BlockGroup, fmt: WeightFormat) -> int:
    """Weights of one block of `group` that `fmt` quantizes."""
    return sum(o * i for o, i in _shapes(spec, group) if weight_bytes(fmt, o, i)[1])


# ---- the decode

def decode_gbps(name: str, hw: HardwareSpec) -> tuple[float, bool]:
    """(GB/s of dequantized output, measured) of format `name` on `hw`: calibrate's measurement, else
    SUPPOSED_DECODE_SHARE x the memory bandwidth (measured False)."""
    rate = hw.format_decode_gbps.get(name)
    if rate is not None:
        return float(rate), True
    return SUPPOSED_DECODE_SHARE[name] * hw.hbm_gbps, False


def block_decode_s(block: StoredBlock | None, hw: HardwareSpec) -> float:
    """Seconds one call of a block spends dequantizing its weights on the GPU: each type's decoded bytes at its
    rate (0 for a block in the model's own dtype)."""
    if block is None:
        return 0.0
    return sum(nbytes / (decode_gbps(name, hw)[0] * 1e9) for name, nbytes in block.decoded.items())


def decoded_bytes(block: StoredBlock | None) -> float:
    """Bytes a block's quantized weights take decoded (compute dtype): what decoding ahead writes into a decode
    buffer (0 in the model's own dtype)."""
    return float(sum(block.decoded.values())) if block is not None else 0.0


def decode_split(groups: list[BlockGroup], streams: list[bool], decode: str,
                 hw: HardwareSpec) -> tuple[list[float], list[float]]:
    """Per block (in `groups`' order): (seconds its layers dequantize in its own forward, seconds it is decoded
    ahead on the copy stream). Decoding ahead (offload decode "ahead", runtime/codecs/ahead.py) takes a streamed
    block's decode out of its forward; a block that does not stream (resident) decodes in its forward either way."""
    own: dict[int, float] = {}
    for g in groups:  # once per group (a model has one or two)
        if id(g) not in own:
            own[id(g)] = block_decode_s(g.stored, hw)
    in_forward, ahead = [], []
    for g, s in zip(groups, streams):
        t = own[id(g)]
        early = decode == "ahead" and s
        in_forward.append(0.0 if early else t)
        ahead.append(t if early else 0.0)
    return in_forward, ahead


def dequant_peak(spec: ModelSpec) -> float:
    """The transient a stored format's dequantization adds to the GPU peak: the largest quantized weight of any
    block, in the compute dtype (one layer dequantizes at a time; 0 in the model's own dtype)."""
    return float(max((g.stored.dequant_peak_bytes for g in spec.blocks if g.stored is not None), default=0))
