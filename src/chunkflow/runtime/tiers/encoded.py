"""The encoded tier: blocks whose streamed tails are kept in host memory encoded by a lossless codec
(OffloadConfig.codec, runtime/codecs/), copied to the device encoded and decoded there before the block runs.

Fewer bytes cross the host link and sit in pinned memory (bf16 weights: about 0.7 of them with exponent-pack), the
same bytes arrive in the slot: outputs are bit for bit those without it.

- At layout each block's tail is read from the checkpoint's files (the loader's; never written), encoded chunk by
  chunk (on the GPU where the module runs on one) and kept in one pinned buffer a block, each chunk 16-byte aligned.
  Encoding is cached per block and layout, so laying out again only encodes blocks whose layout changed.
- A prefetch copies each encoded chunk on the copy stream (`copy`: the bytes sent are the encoded ones) into one of
  CODEC_STAGING_CHUNKS device staging buffers, a decode group's worth each (consecutive chunks of about
  CODEC_DECODE_BYTES, chunkflow_planner.offload.codec_group_chunks: one launch and one event per group, not per
  chunk); once a group is copied, a decode stream of the highest priority decodes it into the slot while the next
  group is copied; a staging buffer takes the next group once its decode is done (an event), and the block's ready
  event follows its decodes (`done`). Without CUDA each chunk is decoded by the reference decoder as it is "copied".
- Outside its forward a tail tensor is what the disk tier makes it: a private copy-on-write map of its bytes in the
  file (no memory until read), the files watched for changes; a write to one, or a tensor the files lack, moves the
  block to the host tier at the next layout (runtime/tiers/disk.py, whose checks this tier shares). So the codec
  needs a module loaded through chunkflow from its folder; without files it is refused before anything changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chunkflow.runtime.codecs import CODECS, Codec
from chunkflow.runtime.errors import OffloadError
from chunkflow.runtime.layout import BlockLayout
from chunkflow.runtime.store import HostStore
from chunkflow.runtime.tensors import all_tensors
from chunkflow.runtime.tiers.disk import DiskFiles, DiskTier, disk_files
from chunkflow_planner.offload import CODEC_STAGING_CHUNKS, codec_group_chunks

ALIGN = 16  # each chunk's encoded bytes start at a multiple of this in its block's buffer


@dataclass
class EncodedBlock:
    """One block's tail encoded: its pinned buffer, each chunk's place in it (by the chunk's first block byte), and
    the layout it was encoded for."""

    key: tuple
    store: HostStore
    chunks: dict[int, tuple[int, int, object]]  # lo -> (encoded offset, encoded bytes, the codec's Chunk)
    raw_bytes: int
    stored_bytes: int


@dataclass(frozen=True)
class DecodeGroup:
    """Consecutive chunks of a block decoded by one launch: their encoded bytes are contiguous in the block's buffer
    from `start`, and land at the same offsets from 0 of a staging buffer."""

    start: int  # encoded offset of its first chunk in the block's buffer
    first: int  # block byte of its first chunk (lo)
    last: int  # block byte of its last chunk (lo)
    nbytes: int  # encoded bytes from its first chunk's start to its last chunk's end
    decode: object  # the codec's Decode of its chunks (tables on the device)


class EncodedSource:
    """A block prefetch from the encoded tier (runtime/chunksource.py's interface)."""

    __slots__ = ("tier", "blk", "groups", "r")

    def __init__(self, tier: EncodedTier, blk: EncodedBlock):
        self.tier, self.blk, self.r = tier, blk, None
        self.groups = tier.groups.get(id(blk))

    def copy(self, slot: torch.Tensor, lo: int, hi: int) -> int:
        off, n, c = self.blk.chunks[lo]
        src = self.blk.store.data[off : off + n]
        t = self.tier
        if not t.staging:  # no CUDA: decoded now, exactly
            t.codec.decode(src, slot[c.dst : c.dst + c.nbytes], nbytes=c.nbytes, k=c.k, n_escapes=c.n_escapes)
            return n
        g = self.groups[lo]
        cs = torch.cuda.current_stream(t.device)  # the copy stream: the streamer copies inside it
        if lo == g.first:  # the group takes the next staging buffer, once the decode that last read it is done
            self.r = t.turn
            t.turn = (self.r + 1) % len(t.staging)
            cs.wait_event(t.free[self.r])
        buf = t.staging[self.r]
        buf[off - g.start : off - g.start + n].copy_(src, non_blocking=True)
        if lo == g.last:  # the group's bytes are all copied: decode them on the decode stream
            copied = torch.cuda.Event()
            copied.record(cs)
            ds = t.decode_stream
            ds.wait_event(copied)
            with torch.cuda.stream(ds):
                g.decode.run(buf, slot, t.decode_config)
            t.free[self.r].record(ds)
        return n

    def done(self, backend) -> None:
        """The block's ready event (recorded next on the copy stream) follows its decodes."""
        if self.tier.staging:
            backend.copy_stream.wait_stream(self.tier.decode_stream)


class EncodedTier(DiskTier):
    """Streamed tails encoded in pinned host memory (module docstring)."""

    name = "encoded"
    recycles = False
    demoted_note = "they stream from host memory as they are, not encoded"

    @classmethod
    def for_setting(cls, cfg, module, n_blocks: int, source) -> EncodedTier | None:
        name = getattr(cfg, "codec", "none")
        if name in (None, "none"):
            return None
        codec = CODECS.get(name)
        if codec is None:
            raise OffloadError(f"codec={name!r}: not a codec chunkflow has; one of 'none', "
                               f"{', '.join(map(repr, CODECS))}")
        if cfg.weight_dtype != "bf16":
            raise OffloadError(f"codec={name!r} encodes the weights' own bytes; with weight_dtype "
                               f"{cfg.weight_dtype!r} they are cast first. Use one or the other")
        files = disk_files(source, f"codec={name!r}")
        tier = cls(set(range(n_blocks)), files, codec)
        tier.note_records(all_tensors(module))
        return tier

    def __init__(self, blocks: set[int], files: DiskFiles, codec: Codec):
        super().__init__(blocks, files)
        self.codec = codec
        self.encoded: dict[int, EncodedBlock] = {}
        self.device: torch.device | None = None
        self.staging: list[torch.Tensor] = []  # the device buffers encoded chunks are copied into, in turn
        self.free: list = []  # per staging buffer: an event after the decode that last read it
        self.turn = 0  # the staging buffer the next chunk takes
        self.groups: dict[int, dict[int, DecodeGroup]] = {}  # id(EncodedBlock) -> each chunk's (lo) decode group
        self.decode_stream = None
        self.decode_config = None  # the decoder's launch shape, the fastest on this device (timed once)

    def laid_out(self, layouts: list[BlockLayout], pin: bool) -> None:
        """Check the files (as the disk tier does), then encode every block whose layout is new."""
        self._check_parts(layouts)
        if pin and not self.codec.gpu_ready():
            raise OffloadError(f"codec={self.codec.name!r} decodes on the GPU with a Triton kernel, and Triton cannot "
                               "be used here; install it (`pip install triton`) or leave the codec off")
        self.device = torch.device("cuda", torch.cuda.current_device()) if pin else torch.device("cpu")
        self._drop_device()
        kept = {}
        for l in self.order:
            b = layouts[l]
            key = (b.resident_bytes, b.nbytes, b.slot_start, tuple(b.chunks))
            old = self.encoded.pop(l, None)
            kept[l] = old if old is not None and old.key == key else self._encode(b, key, pin)
            if old is not None and kept[l] is not old:
                old.store.release()
        for old in self.encoded.values():
            old.store.release()
        self.encoded = kept

    def _raw_tail(self, b: BlockLayout) -> torch.Tensor:
        """Block b's tail [R_l, V_l) read from the files onto the device it is encoded on (gaps zero)."""
        R = b.resident_bytes
        raw = torch.zeros(b.nbytes - R, dtype=torch.uint8, device=self.device)
        entries = [e for e in b.tensors if e.end > R]
        for e, p in zip(entries, self.parts[b.index]):
            n = p.rec.nbytes - p.skip
            if p.held:  # stored in another dtype: converted as the module holds it
                t = torch.empty(e.shape, dtype=e.dtype)
                self.files.read_tensor(p.rec, t)
                flat = t.reshape(-1).view(torch.uint8)[p.skip:]
                raw[p.at : p.at + flat.numel()].copy_(flat)
            else:
                self.files.read_range(p.rec.file, p.rec.begin + p.skip, n, raw[p.at : p.at + n])
        return raw

    def _encode(self, b: BlockLayout, key: tuple, pin: bool) -> EncodedBlock:
        R, A = b.resident_bytes, b.slot_start
        raw = self._raw_tail(b)
        pieces, chunks, off = [], {}, 0
        for lo, hi in b.chunks:
            enc = self.codec.encode(raw[lo - R : hi - R])
            chunks[lo] = (off, enc.stored, self.codec.Chunk(off, lo - A, enc.nbytes, enc.k, enc.n_escapes))
            pieces.append((off, enc.data))
            off += -(-enc.stored // ALIGN) * ALIGN
        store = HostStore(off, pin=pin)
        for at, data in pieces:
            store.data[at : at + data.numel()].copy_(data)
        return EncodedBlock(key, store, chunks, b.nbytes - R, sum(n for _, n, _ in chunks.values()))

    # ---- streaming

    def source(self, store: HostStore, b: BlockLayout, non_blocking: bool) -> EncodedSource:
        blk = self.encoded[b.index]
        if self.device.type == "cuda" and not self.staging:
            self._make_device()
        return EncodedSource(self, blk)

    def _make_device(self) -> None:
        """Every block's decode groups (their tables on the device), the staging buffers (the largest group's encoded
        bytes each), the decode stream, and the decoder's launch shape timed."""
        self.groups = {id(blk): self._groups_of(blk) for blk in self.encoded.values()}
        most = max((g.nbytes for gs in self.groups.values() for g in gs.values()), default=0)
        self.staging = [torch.empty(max(most, 16), dtype=torch.uint8, device=self.device)
                        for _ in range(CODEC_STAGING_CHUNKS)]
        self.free = [torch.cuda.Event() for _ in self.staging]
        self.turn = 0
        if self.decode_stream is None:
            high, _low = torch.cuda.Stream.priority_range()
            self.decode_stream = torch.cuda.Stream(device=self.device, priority=high)
        if self.decode_config is None and self.groups:
            self.decode_config = self._tune()

    def _groups_of(self, blk: EncodedBlock) -> dict[int, DecodeGroup]:
        """The block's chunks in decode groups of codec_group_chunks (the planner's rule), keyed by each chunk's lo."""
        los = sorted(blk.chunks)
        if not los:
            return {}
        per = codec_group_chunks(max(c.nbytes for _, _, c in blk.chunks.values()))
        out: dict[int, DecodeGroup] = {}
        for i in range(0, len(los), per):
            part = los[i : i + per]
            start = blk.chunks[part[0]][0]
            end = blk.chunks[part[-1]][0] + blk.chunks[part[-1]][1]
            rows = [blk.chunks[lo][2]._replace(src=blk.chunks[lo][0] - start) for lo in part]
            g = DecodeGroup(start, part[0], part[-1], end - start, self.codec.Decode(rows, self.device))
            out.update((lo, g) for lo in part)
        return out

    def _tune(self):
        """The decoder's fastest launch shape here, timed on the largest decode group (once an offload)."""
        blk = max(self.encoded.values(), key=lambda blk: max(g.nbytes for g in self.groups[id(blk)].values()))
        g = max(self.groups[id(blk)].values(), key=lambda g: g.nbytes)
        los = [lo for lo in sorted(blk.chunks) if g.first <= lo <= g.last]
        base = blk.chunks[los[0]][2].dst
        rows = [blk.chunks[lo][2]._replace(src=blk.chunks[lo][0] - g.start, dst=blk.chunks[lo][2].dst - base)
                for lo in los]
        self.staging[0][: g.nbytes].copy_(blk.store.data[g.start : g.start + g.nbytes])
        out = torch.empty(sum(blk.chunks[lo][2].nbytes for lo in los) + 2, dtype=torch.uint8, device=self.device)
        config = self.codec.Decode(rows, self.device).tune(self.staging[0], out)
        torch.cuda.synchronize(self.device)
        return config

    def _drop_device(self) -> None:
        if self.staging:
            torch.cuda.synchronize(self.device)
        self.staging, self.free = [], []
        self.groups = {}

    def acquire(self, store: HostStore, b: BlockLayout):
        raise AssertionError("the encoded tier gives a source (`source`), not a flat buffer")

    def prepare(self, b: BlockLayout) -> None:
        pass

    def pause(self) -> None:
        """Parked: the device buffers go with the slots."""
        self._drop_device()

    def release(self, l: int, copied) -> None:
        pass

    def stop(self, cancel: bool = False) -> None:
        pass

    def detach(self, handle) -> None:
        super().detach(handle)
        self._drop_device()

    def close(self, handle, restore: bool) -> None:
        for blk in self.encoded.values():
            blk.store.release()
        self.encoded = {}
        super().close(handle, restore)

    def tail_bytes(self, layouts: list[BlockLayout]) -> int:
        return 0

    def stats(self, layouts: list[BlockLayout]) -> dict:
        blks = [self.encoded[l] for l in self.order if l in self.encoded]
        return dict(codec=self.codec.name, codec_blocks=len(blks),
                    codec_raw_bytes=sum(b.raw_bytes for b in blks),
                    codec_stored_bytes=sum(b.stored_bytes for b in blks),
                    codec_host_bytes=sum(b.store.nbytes for b in blks),
                    codec_pinned_bytes=sum(b.store.pinned_bytes for b in blks),
                    codec_staging_bytes=sum(t.numel() for t in self.staging),
                    codec_decode_config=str(self.decode_config) if self.decode_config is not None else "")
