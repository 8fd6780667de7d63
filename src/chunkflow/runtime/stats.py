"""What `handle.stats()` reports of an offloaded module: its layout, memory and what the ring has done so far."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class OffloadStats:
    mode: str
    device: str
    chunk_bytes: int | None  # None: whole block per copy (layerwise) or no streaming (none)
    n_blocks: int
    n_streamed_blocks: int
    bytes_offloaded: int  # the blocks' tensor bytes kept in the host store
    host_bytes: int  # host store size (tensor bytes plus alignment padding)
    pinned_bytes: int  # page-locked bytes (0 without CUDA)
    resident_bytes: int  # sum R_l: blocks' bytes kept on the device for good
    non_block_bytes: int  # non-block parameters and buffers on the device
    streamed_bytes_per_step: int  # H2D bytes per full forward: sum (V_l - R_l)
    d2d_bytes_per_step: int  # straddling tensors' resident bytes copied into slots per forward
    target_residency: float
    achieved_residency: float  # sum R_l / sum V_l
    slot_bytes: int  # one streaming slot
    device_buffer_bytes: int  # resident buffer plus both slots (plus the cast and decode buffers)
    forwards: int  # forwards seen by the ring so far
    h2d_bytes_issued: int  # H2D bytes enqueued so far
    blocks_computed: int = 0  # block runs whose own forward ran, so far (runtime/runs.py)
    blocks_skipped: int = 0  # block runs a cache skipped (the block was called, its forward replaced), so far
    skipped_h2d_bytes: int = 0  # of h2d_bytes_issued, those copied for the skipped block runs (copies wasted)
    comm_aware: bool = False  # chunks are paced around collectives now (chunkflow mode, collectives seen)
    refreshes: int = 0  # forwards that re-copied blocks to the device after writes while offloaded
    relayouts: int = 0  # times the blocks were laid out again (new tensors, a dtype change, the order they ran in)
    reorders: int = 0  # of those, into the order the first forward entered the blocks (runtime/order.py)
    weight_dtype: str = "bf16"  # storage of the blocks' weights: bf16 (as the model holds them) or fp8_e4m3
    fp8_tensors: int = 0  # block tensors stored in fp8 (cast to their compute dtype at each block's forward)
    cast_buffer_bytes: int = 0  # device bytes the fp8 -> compute-dtype cast writes into: one block's worth; with
    # fp8_cast "copy" one per slot, and one more where some blocks do not stream (they are cast on the compute stream)
    fp8_cast_kernel: str = ""  # with fp8 storage on a device: the kernel that casts, triton or torch (runtime/fp8cast.py)
    decode: str = "ahead"  # quantized weights of streamed blocks: decoded ahead (runtime/codecs/ahead.py) or in the forward
    decoded_tensors: int = 0  # block tensors decoded ahead (GGUF types, fp8-scaled) into their compute dtype
    decoded_stored_bytes: int = 0  # their bytes as stored (what the slots take and a forward copies)
    decoded_bytes: int = 0  # the same decoded, summed over the streamed blocks
    decode_buffer_bytes: int = 0  # device bytes they are decoded into: one buffer per slot, each the largest streamed
    # block's decoded weights (256-byte aligned); in device_buffer_bytes
    disk_blocks: int = 0  # blocks whose streamed bytes are read from the checkpoint's files each forward
    disk_bytes_per_step: int = 0  # bytes a full forward reads from disk
    disk_bytes_read: int = 0  # bytes read from disk so far
    codec: str = "none"  # the codec streamed tails are kept encoded with (runtime/codecs/layer.py), or none
    codec_blocks: int = 0  # blocks streamed encoded
    codec_raw_bytes: int = 0  # their tails' bytes as the model holds them (what a forward would copy raw)
    codec_stored_bytes: int = 0  # the same encoded: what a forward copies and pinned memory holds (less alignment)
    codec_host_bytes: int = 0  # host memory the encoded tails take (chunks 16-byte aligned)
    codec_pinned_bytes: int = 0  # of which page-locked (0 without CUDA)
    codec_shared_bytes: int = 0  # of which in one copy the local ranks of this host share (counted once per host)
    codec_staging_bytes: int = 0  # the device buffers encoded chunks are copied into before their decode
    codec_decode_config: str = ""  # the decoder's launch shape timed fastest on this GPU (exponent_pack_gpu.CONFIGS)
    codec_disk_blocks: int = 0  # disk blocks streamed encoded: read encoded from the spill file, decoded on the device
    codec_disk_raw_bytes: int = 0  # their tails' bytes as the model holds them
    codec_disk_stored_bytes: int = 0  # the same encoded (what a forward reads from disk and copies)
    codec_spill_bytes: int = 0  # the spill file's size on disk (unlinked: gone with the process)
    codec_disk_staging_bytes: int = 0  # the disk blocks' own staging buffers on the device
    disk_read_stall_s: float = 0.0  # seconds the copy stream's issuer waited for a read to finish
    disk_ring_bytes: int = 0  # page-locked ring buffers the reads land in
    park_to: str = "host"  # where the tensors outside the blocks wait while parked: host memory or the files (disk)
    disk_park_bytes: int = 0  # of those, bytes left in the checkpoint's files while parked (park_to disk)
    disk_unpark_bytes_read: int = 0  # bytes read from the files by unparks so far
    shared_blocks: int = 0  # blocks streamed from the host copy the ranks of this host share (runtime/tiers/shared.py)
    shared_bytes: int = 0  # that copy's size (counted once per host, whichever rank reports it)
    shared_tail_bytes: int = 0  # of which the tails of the blocks still in it
    shared_pinned_bytes: int = 0  # page-locked by this rank for its GPU (0 without CUDA)
    shared_owner: bool = False  # this rank (local rank 0) filled it
    shared_park_bytes: int = 0  # parked tensors in one copy the ranks of this host share

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        from chunkflow_planner.units import format_bytes

        if self.mode == "none":
            return f"not streamed: every tensor on {self.device} ({format_bytes(self.non_block_bytes)})"
        return (f"{self.mode} on {self.device}: {self.n_streamed_blocks} of {self.n_blocks} blocks streamed"
                + (f" in {format_bytes(self.chunk_bytes)} chunks" if self.chunk_bytes else "")
                + f", {format_bytes(self.streamed_bytes_per_step)} a forward; {format_bytes(self.resident_bytes)} "
                f"resident ({self.achieved_residency:.0%}); {format_bytes(self.host_bytes)} in host memory"
                + (f" ({format_bytes(self.pinned_bytes)} pinned)" if self.pinned_bytes else "")
                + (f"; {self.disk_blocks} blocks read from disk ({format_bytes(self.disk_bytes_per_step)} a forward, "
                   f"{format_bytes(self.disk_ring_bytes)} ring)" if self.disk_blocks else "")
                + f"; {format_bytes(self.device_buffer_bytes + self.non_block_bytes)} on the device; "
                f"{self.forwards} forwards so far"
                + (f"; {self.blocks_skipped} of {self.blocks_skipped + self.blocks_computed} block runs skipped by a "
                   f"cache ({format_bytes(self.skipped_h2d_bytes)} copied for them)" if self.blocks_skipped else ""))
