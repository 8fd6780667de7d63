"""The encoded tier: blocks whose streamed tails are kept in host memory encoded by a lossless codec
(OffloadConfig.codec, runtime/codecs/), copied to the device encoded and decoded there before the block runs.

Fewer bytes cross the host link and sit in pinned memory (bf16 weights: about 0.7 of them with exponent-pack), the
same bytes arrive in the slot: outputs are bit for bit those without it.

- At layout each block's tail is read from the checkpoint's files (the loader's; never written), encoded chunk by
  chunk (on the GPU where the module runs on one) and kept in one pinned buffer a block, each chunk 16-byte aligned.
  Encoding is cached per block and layout, so laying out again only encodes blocks whose layout changed.
- A prefetch copies the block's encoded chunks into one device staging buffer on the copy stream (`copy`: the bytes
  sent are the encoded ones); when the block's chunks are all enqueued (`done`), one launch on a decode stream of
  the highest priority decodes them into the slot, and the copy stream waits for it before the block's ready event
  (so the next block's copies cannot overwrite the staging buffer it reads). Without CUDA each chunk is decoded by
  the reference decoder as it is "copied".
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


class EncodedSource:
    """A block prefetch from the encoded tier (runtime/chunksource.py's interface)."""

    __slots__ = ("tier", "blk", "slot")

    def __init__(self, tier: EncodedTier, blk: EncodedBlock):
        self.tier, self.blk, self.slot = tier, blk, None

    def copy(self, slot: torch.Tensor, lo: int, hi: int) -> int:
        off, n, c = self.blk.chunks[lo]
        self.slot = slot
        src = self.blk.store.data[off : off + n]
        if self.tier.staging is None:  # no CUDA: decoded now, exactly
            self.tier.codec.decode(src, slot[c.dst : c.dst + c.nbytes], nbytes=c.nbytes, k=c.k, n_escapes=c.n_escapes)
        else:
            self.tier.staging[off : off + n].copy_(src, non_blocking=True)
        return n

    def done(self, backend) -> None:
        tier = self.tier
        if tier.staging is None or self.slot is None:
            return
        copied = backend.event()
        copied.record(backend.copy_stream)
        ds = tier.decode_stream
        ds.wait_event(copied)
        with torch.cuda.stream(ds):
            tier.decoders[id(self.blk)].run(tier.staging, self.slot)
        decoded = backend.event()
        decoded.record(ds)
        backend.copy_stream.wait_event(decoded)
        tier.bytes_decoded += self.blk.raw_bytes


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
        self.staging: torch.Tensor | None = None  # the device buffer a block's encoded chunks are copied into
        self.decoders: dict[int, object] = {}  # id(EncodedBlock) -> its decode (tables on the device)
        self.decode_stream = None
        self.bytes_decoded = 0

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
        if self.device.type == "cuda" and self.staging is None:
            self._make_device()
        return EncodedSource(self, blk)

    def _make_device(self) -> None:
        """The staging buffer (the largest block's encoded bytes), every block's decode table, the decode stream."""
        most = max((blk.store.nbytes for blk in self.encoded.values()), default=0)
        self.staging = torch.empty(max(most, 1), dtype=torch.uint8, device=self.device)
        self.decoders = {id(blk): self.codec.Decode([c for _, _, c in blk.chunks.values()], self.device)
                         for blk in self.encoded.values()}
        if self.decode_stream is None:
            high, _low = torch.cuda.Stream.priority_range()
            self.decode_stream = torch.cuda.Stream(device=self.device, priority=high)

    def _drop_device(self) -> None:
        if self.staging is not None:
            torch.cuda.synchronize(self.device)
        self.staging = None
        self.decoders = {}

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
                    codec_staging_bytes=self.staging.numel() if self.staging is not None else 0)
