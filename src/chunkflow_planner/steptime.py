"""Denoising step time per offload mode: compute, collectives, exposed prefetch, contention, overhead.

Each block l computes for T_comp,l (eq. 1, with eta_comp at that block's F when the profile has a measured
eta_comp(F) curve) and, under Ulysses SP, runs n_coll all-to-alls. Meanwhile
the copy stream fetches block l+1 (the last block fetches the first, for the next forward):
T_pref = streamed bytes / (eta_pref BW_h2d) (eq. 2) plus a DMA start-up cost per copy (chunk-size
efficiency). `chunkflow calibrate` fits t(C) = dma_startup + C / BW_h2d to pinned copies of 1-256 MB, so in a
calibrated profile BW_h2d is the asymptotic rate, the DMA term carries the whole size effect and eta_pref is 1. A block's wall time is the longer of the two paths, plus:
- layerwise (and chunkflow without communication awareness): collectives that meet an in-flight H2D
  copy run `contention` times slower, for the fraction of the block window the prefetch is in flight;
  on a PCIe peer link the collective's bytes also occupy the path the prefetch needs.
- chunkflow with communication awareness: copies pause at chunk boundaries while a collective runs, so
  prefetch progresses only in compute windows; each collective waits on average for half of the chunk in
  flight (bounded by one chunk's service time, section 3.2), and pays a small yield overhead. Where the
  compute windows cannot hold a block's transfer the runtime does not yield: the better schedule applies.
Step time = cfg_passes * sum over blocks, or one forward of cfg_passes times the batch with batched CFG (each block
streamed once a step). With fp8 weight storage the streamed bytes halve and each block pays, on the compute path,
a cast of its weights to bf16 (bf16 bytes / the profile's cast rate). Cast on the copy stream (fp8_cast "copy"), the
cast still takes its time from the compute path (its kernels share the SMs with the block they overlap: on an
H200 a copy-stream cast ran 1-2% faster than a compute-stream one for Wan2.2-TI2V-5B, where a cast that cost the
compute stream nothing would have saved its 6-12% of the step, and Qwen-Image's copy-stream plan ran 7% over a free
cast) and also lengthens the copy path. With a codec (issue 39, tiers.py) a host-tier block's streamed bytes cross
the link encoded (rho B in eq. 2) and are decoded on the GPU, chunk by chunk behind the next chunk's copy: the decode
(B / D) is added to the compute path of the block whose window it runs in (its kernels share the SMs, as the cast's
do), and the last chunk's decode, which no copy hides, to the copy path. The disk tier's blocks stream encoded too
(from the codec's spill file, memory.disk_bytes): the same rho and decode, and rho of their bytes read from disk.
A stored format (issue 52, formats.py) streams its stored bytes (the blocks' volumes are theirs) and each block
dequantizes its weights in its own forward, on the compute stream: their decoded bytes at the format's rate are added
to the block's compute path, in every mode (diffusers' GGUF pipeline all on the GPU dequantizes every forward too).
Decoded ahead (offload decode "ahead"; "forward" is the default) a streamed block's decode leaves its forward and runs
on the copy stream right after its copies: like the codec's decode it is added to the copy path (after the block's
last copy, nothing hides it) and to the compute path of the block whose window it runs in (its kernels share the
SMs; a copy-stream cast ran within 1-2% of a compute-stream one, above).
Non-block layers are not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from chunkflow_planner.catalog import BlockGroup, HardwareSpec, ModelSpec, Workload
from chunkflow_planner.flops import F_kind
from chunkflow_planner.formats import decode_split
from chunkflow_planner.memory import block_volumes, disk_bytes, stored_volumes
from chunkflow_planner.offload import (PACING_MARGIN, OffloadConfig, codec_group_bytes, codec_groups, per_volume,
                                      resident_list, streaming_volumes)
from chunkflow_planner.overlap import GB, T_comp_hw, T_pref, eta_samples
from chunkflow_planner.tiers import DiskRateUnknown, codec_ratio, decode_s, read_s  # noqa: F401 (DiskRateUnknown: its old home)
from chunkflow_planner.workload import per_forward, tokens

COLLECTIVES_PER_BLOCK = 4  # Ulysses: all-to-all of q, k, v before attention and of the output after it
COLLECTIVE_LATENCY_S = 15e-6


@dataclass
class StepTime:
    """Predicted time of one denoising step and where it goes (seconds)."""

    compute: float = 0.0
    collective: float = 0.0
    prefetch_stall: float = 0.0
    contention_stall: float = 0.0
    overhead: float = 0.0
    disk_stall: float = 0.0  # disk tier: what a forward waits for its reads beyond its own time
    per_block: list[float] = field(default_factory=list, repr=False)
    first_only: float = 0.0  # one forward that runs only the first block (a first-block cache's hit): first_only_s

    @property
    def total(self) -> float:
        return (self.compute + self.collective + self.prefetch_stall + self.contention_stall + self.overhead
                + self.disk_stall)


def t_all_to_all(spec: ModelSpec, group: BlockGroup, w: Workload, hw: HardwareSpec, sp: int) -> float:
    """One Ulysses all-to-all of this block: B * T_local * d * dtype_bytes over the peer link."""
    if sp <= 1:
        return 0.0
    T = tokens(spec, w) + (spec.text_len if group.kind != "dit" else 0)
    nbytes = w.batch * (T / sp) * spec.d * spec.dtype_bytes
    return nbytes / (hw.coll_gbps * GB) + COLLECTIVE_LATENCY_S


def block_time(
    t_comp: float, t_coll: float, n_coll: int, V_next: float, cfg: OffloadConfig, hw: HardwareSpec,
    t_cast_next: float = 0.0, rho_next: float = 1.0, t_decode_chunk: float = 0.0,
) -> tuple[float, float, float, float]:
    """(wall, prefetch stall, contention stall, overhead) of one block that prefetches a V_next-byte block;
    `t_cast_next`: the next block's fp8 cast when it runs on the copy stream after its copies (fp8_cast "copy");
    `rho_next`: the share of its streamed bytes the link carries (the codec's ratio, 1 raw) and `t_decode_chunk`
    the decode of its last chunk, after the last copy (eq. 2 extended by the codec, tiers.py).

    With communication awareness the runtime yields only where the compute windows can hold the transfer
    (runtime/comm.py: the block's bytes fit in PACING_MARGIN of its compute time); a prefetch-bound block is
    issued at once, as without awareness. Where it yields, the prediction is the better of the two schedules.
    """
    window = t_comp + t_coll
    if cfg.mode == "none":
        return window, 0.0, 0.0, 0.0
    streamed = cfg.streamed_bytes(V_next)
    if streamed <= 0:
        return window, 0.0, 0.0, 0.0
    BW = hw.h2d_gbps * GB
    dma = hw.dma_startup_us * 1e-6
    pref = link_s(V_next, cfg, hw, rho_next, t_decode_chunk) + t_cast_next
    overhead = hw.block_overhead_us * 1e-6

    def finish(contention: float, link_busy: float, extra: float) -> tuple[float, float, float, float]:
        compute_path = window + contention
        wall = max(compute_path, link_busy)
        return wall + overhead + extra, wall - compute_path, contention, overhead + extra

    if t_coll <= 0:
        return finish(0.0, pref, 0.0)
    # copies in flight during collectives slow them by `contention`; on a PCIe peer link they also share the path
    in_flight = min(1.0, pref / window)
    blind = finish((hw.contention - 1) * t_coll * in_flight,
                   pref + (t_coll * in_flight if hw.peer_link == "pcie" else 0.0), 0.0)
    if cfg.mode != "chunkflow" or not cfg.comm_aware:
        return blind
    # yielding: copies pause while collectives run; each collective waits for about half the chunk in flight
    in_flight = min(1.0, pref / max(t_comp, 1e-12))
    t_chunk = T_pref(rho_next * cfg.chunk_service_bytes(V_next), BW, hw.eta_pref) + dma
    tail = n_coll * in_flight * (1 - 1 / hw.contention) * 0.5 * t_chunk
    aware = finish(tail, pref + t_coll, n_coll * hw.yield_overhead_us * 1e-6)
    fits = pref <= PACING_MARGIN * t_comp
    return min(aware, blind) if fits else blind


def step_time(
    spec: ModelSpec,
    w: Workload,
    hw: HardwareSpec,
    cfg: OffloadConfig,
    sp: int = 1,
    prefetch_bytes: float | None = None,
    text_len: float | None = None,
) -> StepTime:
    """Predicted step time of `w` on `hw` under `cfg` (per GPU; all GPUs of an SP group run in lockstep)."""
    hw = hw.for_model(spec)
    L = spec.text_len if text_len is None else text_len
    w, passes = per_forward(w, cfg.cfg_batched)
    S = tokens(spec, w)
    same = eta_samples(spec, w.batch)
    groups = spec.block_sequence()
    V = block_volumes(spec) if prefetch_bytes is None else [float(prefetch_bytes)] * len(groups)
    cast = [0.0] * len(groups) if cfg.weight_dtype == "bf16" else [v / (hw.cast_gbps * GB) for v in V]
    V = (stored_volumes(spec, cfg) if prefetch_bytes is None
         else [cfg.stored_bytes(v, spec.dtype_bytes) for v in V])
    stored = V
    V = streaming_volumes(cfg, V)  # a whole block (offload.whole_blocks) streams nothing: 0 bytes to the streaming
    # fp8_cast "copy": a streamed block is cast on the copy stream after its copies (the runtime casts a block
    # that does not stream on the compute stream)
    on_copy = per_volume(lambda v: cfg.fp8_cast == "copy" and cfg.streamed_bytes(v) > 0, V)
    rho, dec, dec_chunk = codec_terms(V, cfg, hw)
    # a stored format's decode (formats.py): in each block's forward, or ahead, on the copy stream after its copies
    dequant, ahead = decode_split(groups, per_volume(lambda v: cfg.streamed_bytes(v) > 0, V), cfg.decode, hw)
    out = StepTime()
    seen: dict[tuple, tuple[float, float, float, float, float, float]] = {}  # blocks alike are computed once
    n = len(groups)
    keys = zip([g.kind for g in groups], V, V[1:] + V[:1], on_copy, on_copy[1:] + on_copy[:1], cast,
               cast[1:] + cast[:1], rho[1:] + rho[:1], dequant, ahead[1:] + ahead[:1])  # block l's and (l + 1) % n's
    compute = collective = prefetch_stall = contention_stall = overhead = window0 = 0.0  # summed block by block
    for l, key in enumerate(keys):
        if key not in seen:
            g, nxt = groups[l], (l + 1) % n
            tc = T_comp_hw(F_kind(g.kind, w.batch, S, L, spec.d, spec.f) / sp, hw, same)  # eta_comp of this block
            tc += cast[l] + dequant[l]  # on either stream: the cast kernels take the SMs (module docstring)
            tc += dec[nxt] + ahead[nxt]  # the next block's decodes run in this block's window, on the SMs too
            n_coll = COLLECTIVES_PER_BLOCK if sp > 1 else 0
            tcoll = n_coll * t_all_to_all(spec, g, w, hw, sp)
            seen[key] = (tc, tcoll, *block_time(tc, tcoll, n_coll, V[nxt], cfg, hw,
                                                  cast[nxt] if on_copy[nxt] else 0.0, rho[nxt],
                                                  dec_chunk[nxt] + ahead[nxt]))  # after its copies: the copy path
        tc, tcoll, wall, stall, cont, over = seen[key]
        window0 = tc + tcoll if l == 0 else window0
        compute += tc
        collective += tcoll
        prefetch_stall += stall
        contention_stall += cont
        overhead += over
        out.per_block.append(wall)
    out.compute, out.collective, out.prefetch_stall = compute, collective, prefetch_stall
    out.contention_stall, out.overhead = contention_stall, overhead
    out.disk_stall = disk_stall(sum(out.per_block), stored, cfg, hw)
    out.first_only = first_only_s(window0, out.per_block, V, cfg, hw, rho, dec_chunk)
    for name in ("compute", "collective", "prefetch_stall", "contention_stall", "overhead", "disk_stall"):
        setattr(out, name, getattr(out, name) * passes)
    return out


def codec_terms(V: list[float], cfg: OffloadConfig, hw: HardwareSpec) -> tuple[list[float], list[float],
                                                                            list[float]]:
    """Per block: (rho, the link's share of its streamed bytes; T_dec of its streamed bytes plus its decode launches'
    host cost, both on the compute path; T_dec of its last decode group, offload.codec_group_bytes) for every block
    that streams, host tier and disk tier alike (eq. 2 and eq. 1 extended by the codec, tiers.py); (1, 0, 0) without
    a codec. Raises tiers.CodecRateUnknown where the codec is on and the profile has no decode rate."""
    n = len(V)
    if cfg.codec == "none":
        return [1.0] * n, [0.0] * n, [0.0] * n
    ratio = codec_ratio(hw)[0]
    launch = hw.codec_launch_us * 1e-6

    def terms(v: float) -> tuple[float, float, float]:  # a block's three, computed once per distinct volume
        if not cfg.streamed_bytes(v) > 0:
            return 1.0, 0.0, 0.0
        return (ratio, decode_s(cfg.streamed_bytes(v), hw) + launch * codec_groups(cfg, v),
                decode_s(codec_group_bytes(cfg, v), hw))

    per_block = per_volume(terms, V)
    return [t[0] for t in per_block], [t[1] for t in per_block], [t[2] for t in per_block]


def disk_stall(forward_s: float, V: list[float], cfg: OffloadConfig, hw: HardwareSpec) -> float:
    """What one forward of `forward_s` seconds waits for the disk tier: the reader reads every disk block's tail
    (memory.disk_bytes: with a codec, its encoded bytes from the spill file, rho of them) once a forward, one block ahead of its copies, on a link of its own, so the forward takes
    the longer of its own time and the reads (T_disk at the disk tier's rate, tiers.py); the first read of a forward
    overlaps the previous one's last blocks. Raises tiers.DiskRateUnknown where the profile has no disk rate."""
    if not cfg.disk_blocks:
        return 0.0
    read, _ = disk_bytes(V, resident_list(cfg, V), cfg, hw)
    return max(0.0, read_s(read, "disk", hw) - forward_s)


def link_s(V: float, cfg: OffloadConfig, hw: HardwareSpec, rho: float = 1.0, t_decode_chunk: float = 0.0) -> float:
    """The copy path of one block's streamed bytes (eq. 2: T_pref of rho of them, a DMA start-up per copy, the last
    decode group's decode); 0 where the block streams nothing."""
    streamed = cfg.streamed_bytes(V)
    if cfg.mode == "none" or streamed <= 0:
        return 0.0
    return (T_pref(rho * streamed, hw.h2d_gbps * GB, hw.eta_pref) + cfg.copies(V) * hw.dma_startup_us * 1e-6
            + t_decode_chunk)


def first_only_s(window0: float, per_block: list[float], V: list[float], cfg: OffloadConfig, hw: HardwareSpec,
                 rho: list[float], dec_chunk: list[float]) -> float:
    """One forward that runs only the first block and skips the rest (a first-block cache's hit, stepcache.py), as the
    runtime streams it (runtime/streamer.py): the first block prefetches the second as it runs; the rest are skipped,
    and the first block, streamed, is copied again for the next forward (prefetch_first) behind the second's copy, so
    the forward takes the longer of its compute path and both copies. A first block kept whole (offload whole_blocks)
    copies nothing: the second stays in its slot from the forward before, and the forward is the block's compute
    window (`window0`). V: the streaming volumes (offload.streaming_volumes)."""
    if not per_block:
        return 0.0
    if cfg.streamed_bytes(V[0]) <= 0:
        return window0
    both = sum(link_s(V[l], cfg, hw, rho[l], dec_chunk[l]) for l in range(min(2, len(V))))
    return max(per_block[0], both + hw.block_overhead_us * 1e-6)
