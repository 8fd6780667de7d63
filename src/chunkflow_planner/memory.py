"""Peak GPU memory and pinned host bytes per offload mode.

Assumptions (stated so they can be checked against `chunkflow run`):
- Weights: `none` keeps all; `layerwise` keeps non-block weights plus two whole-block buffers (the block
  computing and the one being prefetched); `chunkflow` keeps non-block weights, each block's resident
  chunks R_l, and two streaming slots sized to the largest streamed extent max_l (V_l - R_l).
- Activations: the peak inside one block, dtype_bytes * B * T_local * (c_f * f + c_d * d), with T_local the
  tokens a GPU holds (S / SP for DiT; (S + L) / SP for MM-DiT, which concatenates the text). c_f = 2 counts
  the MLP's up-projection and activation output; c_d = 4 the residual stream, its normed copy and the
  attention's q, k, v / output (Ulysses gathers full-sequence q, k, v of 1/SP of the heads: the same bytes).
  Flash-style attention keeps no S x S matrix. Per-model coefficients live in models.yaml. A pipeline that
  gives every token its own timestep (Wan2.2-TI2V) adds 38 bytes per token and hidden unit (PER_TOKEN_TIMESTEP_BYTES).
- Batched CFG: the activations of one forward of cfg_passes times the batch. fp8 weight storage: the resident
  heads, slots and pinned store hold 1 byte per weight, plus one block's weights in bf16 (the cast's target).
- Codec (issue 39): the host tier's streamed tails are held encoded, rho of their bytes (tiers.py), and the device
  holds a staging ring of CODEC_STAGING_CHUNKS of the largest streamed chunk the encoded copies land in. The disk
  tier's tails are encoded too: at the load into one spill file chunkflow owns (rho of their bytes, disk space, not
  host memory), read from it each forward into a ring of DISK_RING_BLOCKS of the largest encoded tail.
- Stored format (issue 52, formats.py): every weight byte above is the format's (the blocks' volumes are their stored
  bytes, ModelSpec.block_bytes), and one layer's dequantized weight lives beside them while it runs, in every mode
  (the largest quantized weight of a block in the compute dtype: `dequant`). Decoded ahead (offload decode "ahead"),
  a streamed block's weights are decoded into one of two decode buffers instead (`decode_buffers`: the largest
  streamed block's quantized weights in the compute dtype, each), and only blocks that do not stream keep `dequant`.
- Prediction = torch's peak allocated bytes. The budget check (`device_need`) adds what the allocator holds of freed
  activations (the hardware's alloc_slack, measured: about a third of the activations on an H200), its reserve
  (reserve_fraction) and the device memory torch does not count (context_bytes: CUDA context and libraries).
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import sub

from chunkflow_planner.catalog import HardwareSpec, ModelSpec, Workload
from chunkflow_planner.formats import decoded_bytes, dequant_peak
from chunkflow_planner.offload import (DISK_RING_BLOCKS, OffloadConfig, codec_staging_bytes, disk_block_indices, resident_list)
from chunkflow_planner.tiers import encoded_bytes
from chunkflow_planner.workload import per_forward, tokens

# per token and hidden unit, with per-token timesteps (Wan2.2-TI2V): the (6, d) modulation projection in bf16 held
# for the whole forward (12 bytes), each block's fp32 copy of it plus its table (24) and the bf16 time embedding (2)
PER_TOKEN_TIMESTEP_BYTES = 38


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted peak GPU bytes, split by what holds them, and pinned host bytes."""

    non_block_weights: float
    resident_block_weights: float
    streaming_buffers: float
    activations: float
    pinned_host: float
    cast_buffer: float = 0.0  # fp8 storage: one block's weights in bf16, the cast's target (two: cast on copy)
    disk_read: float = 0.0  # disk tier: bytes a forward reads from disk (not in pinned_host): the checkpoint's files,
    # or with a codec the spill file's encoded tails
    disk_ring: float = 0.0  # disk tier: the page-locked ring the reads land in (in pinned_host)
    codec_staging: float = 0.0  # codec: the device ring the encoded chunks are copied into before their decode
    codec_raw: float = 0.0  # codec: the host tier's streamed tails, raw (what a forward decodes)
    codec_stored: float = 0.0  # codec: the same tails encoded, as the host store holds them and the link carries them
    codec_spill_raw: float = 0.0  # codec: the disk tier's tails, raw (read once at the load, decoded each forward)
    codec_spill: float = 0.0  # codec: the same encoded, the spill file (disk space, not host memory): disk_read
    dequant: float = 0.0  # stored format: the dequantized weight of the layer running (formats.dequant_peak)
    decode_buffers: float = 0.0  # stored format decoded ahead: a decode buffer per slot, the largest streamed block's
    # quantized weights in the compute dtype (runtime/codecs/ahead.py)

    @property
    def peak(self) -> int:
        return int(self.non_block_weights + self.resident_block_weights + self.streaming_buffers + self.activations
                   + self.cast_buffer + self.codec_staging + self.dequant + self.decode_buffers)

    @property
    def codec_saved(self) -> float:
        """Bytes the codec keeps out of the host store: the host tier's raw less encoded tails."""
        return self.codec_raw - self.codec_stored

    @property
    def codec_saved_link(self) -> float:
        """Bytes the codec keeps off the host link each forward: codec_saved and the disk tier's raw less encoded
        tails (which it also keeps off the disk each forward)."""
        return self.codec_saved + self.codec_spill_raw - self.codec_spill


def device_need(allocated: float, activations: float, hw: HardwareSpec, slack: float | None = None) -> int:
    """Device bytes in use at a peak allocation on `hw`: the allocation, what the allocator holds of freed
    activations (hw's alloc_slack x activations) and its reserve (reserve_fraction), and the memory torch does not
    count (context_bytes). Where the work's own `slack` was measured (a VAE's decodes: all the allocator reserved
    beyond their peak allocation), it stands for both the slack and the reserve. The one memory model of the plan's
    budget checks, transformer-only and whole-pipeline."""
    if slack is not None:
        return int(allocated + slack * activations + hw.context_bytes)
    return int((allocated + hw.alloc_slack * activations) * (1 + hw.reserve_fraction) + hw.context_bytes)


def allocation_within(budget: float, activations: float, hw: HardwareSpec) -> float:
    """The peak allocation whose device_need is `budget`: device_need solved for the allocation (no paper equation)."""
    return (budget - hw.context_bytes) / (1 + hw.reserve_fraction) - hw.alloc_slack * activations


def activation_bytes(spec: ModelSpec, w: Workload, sp: int = 1) -> float:
    """Peak activation bytes on one GPU inside a block (see the module docstring)."""
    S = tokens(spec, w)
    mmdit = any(g.kind != "dit" for g in spec.blocks)
    T_local = (S + spec.text_len if mmdit else S) / sp
    per_token = spec.activation.c_f * spec.f + spec.activation.c_d * spec.d
    act = spec.dtype_bytes * w.batch * T_local * per_token
    if spec.per_token_timestep:
        act += w.batch * T_local * spec.d * PER_TOKEN_TIMESTEP_BYTES
    return act


_VOLUMES: dict[int, tuple[ModelSpec, list[int]]] = {}


def block_volumes(spec: ModelSpec) -> list[int]:
    """V_l: parameter bytes of each block in execution order (kept per spec object: the policy asks often)."""
    hit = _VOLUMES.get(id(spec))
    if hit is None or hit[0] is not spec:
        if len(_VOLUMES) > 256:
            _VOLUMES.clear()
        hit = (spec, [spec.block_bytes(g) for g in spec.block_sequence()])
        _VOLUMES[id(spec)] = hit
    return list(hit[1])


_STORED: dict[int, tuple[ModelSpec, list[int]]] = {}


def stored_volumes(spec: ModelSpec, cfg: OffloadConfig) -> list[float]:
    """Each block's bytes in the host store under `cfg`: V_l, or with fp8 storage the bytes of its cast and kept
    tensors (catalog.ModelSpec.block_stored_bytes), as the runtime's layout packs them."""
    if cfg.weight_dtype == "bf16":
        return [float(v) for v in block_volumes(spec)]
    hit = _STORED.get(id(spec))
    if hit is None or hit[0] is not spec:
        if len(_STORED) > 256:
            _STORED.clear()
        hit = (spec, [spec.block_stored_bytes(g, True) for g in spec.block_sequence()])
        _STORED[id(spec)] = hit
    return [float(v) for v in hit[1]]


_CAST: dict[int, tuple[ModelSpec, list[float]]] = {}


def cast_volumes(spec: ModelSpec) -> list[float]:
    """Each block's tensors fp8 storage casts, in their compute dtype: the cast buffer one block needs (kept per spec
    object, as block_volumes: every fp8 point of the policy asks)."""
    hit = _CAST.get(id(spec))
    if hit is None or hit[0] is not spec:
        if len(_CAST) > 256:
            _CAST.clear()
        hit = (spec, [float((spec.block_params(g) - spec.block_fp8_kept_params(g)) * spec.dtype_bytes)
                      for g in spec.block_sequence()])
        _CAST[id(spec)] = hit
    return list(hit[1])


def estimate_memory(spec: ModelSpec, w: Workload, cfg: OffloadConfig, sp: int = 1,
                    hw: HardwareSpec | None = None) -> MemoryEstimate:
    """Peak GPU memory and pinned host bytes of running `w` under `cfg` (per GPU); `hw` gives the codec's ratio
    (tiers.codec_ratio; without it the supposed one)."""
    V = block_volumes(spec)
    act = activation_bytes(spec, per_forward(w, cfg.cfg_batched)[0], sp)
    dequant = dequant_peak(spec)
    if cfg.mode == "none":
        return MemoryEstimate(spec.non_block_bytes, float(sum(V)), 0.0, act, 0.0, dequant=dequant)
    full = V
    V = stored_volumes(spec, cfg)
    resident = resident_list(cfg, V)
    slot = max(map(sub, V, resident))
    if cfg.weight_dtype != "bf16":  # the cast's target: one block's cast tensors in bf16 (not the ones kept)
        full = cast_volumes(spec)
    cast = 0.0 if cfg.weight_dtype == "bf16" else float(max(full))
    if cfg.weight_dtype != "bf16" and cfg.fp8_cast == "copy":
        # a cast buffer per slot for the blocks that stream, and the compute stream's one for those that do not
        streams = [v - r > 0 for v, r in zip(V, resident)]
        cast = (2.0 * max((f for f, s in zip(full, streams) if s), default=0.0)
                + max((f for f, s in zip(full, streams) if not s), default=0.0))
    on_disk = float(sum(disk_tails(V, resident, cfg)))  # raw: what the host store does not hold
    disk_read, ring = disk_bytes(V, resident, cfg, hw)
    pinned, codec = float(sum(V)) - on_disk + ring, {}
    if cfg.codec != "none":  # the host tier's streamed tails held encoded; the disk tier's in the spill file
        tails = float(sum(V)) - float(sum(resident)) - on_disk
        stored = encoded_bytes(tails, cfg.codec, hw)
        pinned -= tails - stored
        codec = dict(codec_staging=codec_staging_bytes(cfg, V), codec_raw=tails, codec_stored=stored,
                     codec_spill_raw=on_disk, codec_spill=disk_read)
    return MemoryEstimate(spec.non_block_bytes, float(sum(resident)), 2.0 * slot, act, pinned, cast, disk_read, ring,
                          **_decodes(spec, V, resident, cfg), **codec)


def _decodes(spec: ModelSpec, V: list[float], resident: list[float], cfg: OffloadConfig) -> dict[str, float]:
    """A stored format's decode memory: decoded ahead, two decode buffers (one a slot) of the largest streamed
    block's decoded weights, and the dequantized layer of a block that does not stream (it decodes in its forward);
    decoded in the forward, the largest dequantized layer of any block (formats.dequant_peak)."""
    if cfg.decode != "ahead":
        return {"dequant": dequant_peak(spec)}
    streams = [v - r > 0 for v, r in zip(V, resident)]
    groups = spec.block_sequence()
    buffer = max((decoded_bytes(g.stored) for g, s in zip(groups, streams) if s), default=0.0)
    kept = max((float(g.stored.dequant_peak_bytes) for g, s in zip(groups, streams) if not s and g.stored), default=0.0)
    return {"dequant": kept, "decode_buffers": 2.0 * buffer}


def host_need(m: MemoryEstimate, hw: HardwareSpec) -> float:
    """Host bytes the transformer alone holds: its pinned store (with a disk tier, the disk blocks' heads and the
    ring) and what the process holds besides weights (process_host_bytes)."""
    return float(m.pinned_host + hw.pipeline.process_host_bytes)


def disk_tails(V: list[float], resident: list[float], cfg: OffloadConfig) -> list[float]:
    """The disk blocks' streamed tails V_l - R_l, raw (offload.disk_block_indices)."""
    return [V[l] - resident[l] for l in disk_block_indices(len(V), cfg.disk_blocks)]


def disk_bytes(V: list[float], resident: list[float], cfg: OffloadConfig,
               hw: HardwareSpec | None = None) -> tuple[float, float]:
    """(bytes a forward reads from disk, bytes of the ring they land in): the disk blocks' streamed tails (disk_tails),
    and DISK_RING_BLOCKS buffers of the largest (no paper equation: the third tier); with a codec both are the
    encoded tails, rho of them (tiers.encoded_bytes: eq. 2's B_pref under a codec, here on the disk's link), read
    from the spill file; `hw` gives rho (without it the supposed one)."""
    tails = disk_tails(V, resident, cfg)
    if not tails:
        return 0.0, 0.0
    read, largest = encoded_bytes(sum(tails), cfg.codec, hw), encoded_bytes(max(tails), cfg.codec, hw)
    return float(read), float(min(DISK_RING_BLOCKS, len(tails)) * largest)
