"""The encoded tier: blocks whose streamed tails are kept in host memory encoded by a lossless codec
(OffloadConfig.codec, runtime/codecs/), copied to the device encoded and decoded there before the block runs.

Fewer bytes cross the host link and sit in pinned memory (bf16 weights: about 0.7 of them with exponent-pack), the
same bytes arrive in the slot: outputs are bit for bit those without it.

- At layout each block's tail is read from the checkpoint's files (the loader's; never written), encoded chunk by
  chunk (on the GPU where the module runs on one) and kept in one pinned buffer a block, each chunk 16-byte aligned.
  Encoding is cached per block and layout, so laying out again only encodes blocks whose layout changed.
- A prefetch copies the encoded chunks to the device and decodes them there, a decode group at a time, on a stream
  of their own (runtime/codecs/stream.py, which the disk tier's encoded blocks share).
- Under torchrun with more than one local rank (OffloadConfig.share_host, runtime/hostshare.py) the encoded bytes
  of the first layout are one copy per host: local rank 0 reads and encodes every block into a segment it then
  offers with each block's chunk table; the other local ranks map it (their layouts checked against rank 0's) and
  neither read nor encode those blocks. A block laid out anew later is encoded by each rank into its own store.
- Outside its forward a tail tensor is what the disk tier makes it: a private copy-on-write map of its bytes in the
  file (no memory until read), the files watched for changes; a write to one, or a tensor the files lack, moves the
  block to the host tier at the next layout (runtime/tiers/disk.py, whose checks this tier shares). So the codec
  needs a module loaded through chunkflow from its folder; without files it is refused before anything changes.
"""

from __future__ import annotations

import os

import torch

from chunkflow.runtime.codecs import Codec, codec_of
from chunkflow.runtime.codecs.stream import CodecStream, EncodedBlock, EncodedSource, layout_key
from chunkflow.runtime.hostshare import PAGE, HostGroup, SharedSegment, host_group
from chunkflow.runtime.layout import BlockLayout
from chunkflow.runtime.store import HostStore
from chunkflow.runtime.tensors import all_tensors
from chunkflow.runtime.tiers.disk import DiskFiles, DiskTier, _pwrite_all, disk_files
from chunkflow.runtime.tiers.shared import shareable_values


class EncodedTier(DiskTier):
    """Streamed tails encoded in pinned host memory (module docstring)."""

    name = "encoded"
    recycles = False
    demoted_note = "they stream from host memory as they are, not encoded"

    @classmethod
    def for_setting(cls, cfg, module, n_blocks: int, source) -> EncodedTier | None:
        codec = codec_of(cfg)
        if codec is None:
            return None
        files = disk_files(source, f"codec={codec.name!r}")
        group = host_group() if cfg.share_host else None
        values = shareable_values(module, source) if group is not None else None
        tier = cls(set(range(n_blocks)), files, codec, group if values is not None else None, type(module).__name__,
                   values or "")
        tier.note_records(all_tensors(module))
        return tier

    def __init__(self, blocks: set[int], files: DiskFiles, codec: Codec, group: HostGroup | None = None,
                 what: str = "module", values: str = ""):
        super().__init__(blocks, files, codec)
        self.encoded: dict[int, EncodedBlock] = {}
        self.group, self.what, self.values = group, what, values
        self.segment: SharedSegment | None = None  # the first layout's encoded blocks, one copy per host

    def laid_out(self, layouts: list[BlockLayout], pin: bool) -> None:
        """Check the files (as the disk tier does), then encode every block whose layout is new."""
        self._check_parts(layouts)
        self.stream.set_device(pin, f"codec={self.stream.codec.name!r}")
        if self.group is not None and self.segment is None and not self.encoded and self.order:
            self.encoded = self._shared(layouts, pin)
        by_key = {blk.key: blk for blk in self.encoded.values()}  # by block and layout, not index: a re-layout in
        kept = {}  # the order the blocks ran moves them to other indices
        for l in self.order:
            b = layouts[l]
            old = by_key.pop(layout_key(b), None)
            kept[l] = old if old is not None else self._encode(b, pin)
        for old in by_key.values():
            old.store.release()
        self.encoded = kept

    def _encode(self, b: BlockLayout, pin: bool) -> EncodedBlock:
        blk, pieces = self.stream.encode(b, self._raw_tail(b, self.stream.device))
        blk.store = HostStore(blk.nbytes, pin=pin)
        for at, data in pieces:
            blk.store.data[at : at + data.numel()].copy_(data)
        return blk

    def _shared(self, layouts: list[BlockLayout], pin: bool) -> dict[int, EncodedBlock]:
        """Every block encoded once per host: local rank 0 encodes into a segment and offers it with the chunk
        tables; the others take both (runtime/hostshare.py)."""
        manifest = {"module": self.what, "codec": self.stream.codec.name, "values": self.values,
                    "blocks": [[l, repr(layout_key(layouts[l]))] for l in self.order]}
        if self.group.owner:
            fd = SharedSegment.new_fd(self.what)
            try:
                rows, off = {}, 0
                for l in self.order:
                    b = layouts[l]
                    blk, pieces = self.stream.encode(b, self._raw_tail(b, self.stream.device))
                    for at, data in pieces:
                        _pwrite_all(fd, data.cpu().numpy().tobytes(), off + at)
                    rows[str(l)] = [off, blk.raw_bytes, blk.stored_bytes, blk.nbytes,
                                    [[lo, o, n, list(c)] for lo, (o, n, c) in blk.chunks.items()]]
                    off += -(-blk.nbytes // PAGE) * PAGE
            except BaseException:
                os.close(fd)
                raise
            self.segment = SharedSegment.offer_filled(self.group, fd, off, manifest, rows, self.what)
        else:
            self.segment = SharedSegment.join_filled(self.group, manifest, self.what)
            rows = self.segment.extra
        out = {}
        Chunk = self.stream.codec.Chunk
        for l in self.order:
            off, raw, stored, nbytes, chunks = rows[str(l)]
            blk = EncodedBlock(layout_key(layouts[l]), {lo: (o, n, Chunk(*c)) for lo, o, n, c in chunks}, raw,
                               stored, nbytes)
            blk.store = HostStore(nbytes, pin=pin, data=self.segment.shared[off:off + max(nbytes, 1)],
                                  read_only=True)
            out[l] = blk
        return out

    # ---- streaming

    def source(self, store: HostStore, b: BlockLayout, non_blocking: bool) -> EncodedSource:
        blk = self.encoded[b.index]
        return self.stream.source(blk, blk.store.data, self.encoded.values())

    def acquire(self, store: HostStore, b: BlockLayout):
        raise AssertionError("the encoded tier gives a source (`source`), not a flat buffer")

    def prepare(self, b: BlockLayout) -> None:
        pass

    def pause(self) -> None:
        """Parked: the device buffers go with the slots."""
        self.stream.drop_device()

    def release(self, l: int, copied) -> None:
        pass

    def stop(self, cancel: bool = False) -> None:
        pass

    def detach(self, handle) -> None:
        super().detach(handle)
        self.stream.drop_device()

    def close(self, handle, restore: bool) -> None:
        for blk in self.encoded.values():
            blk.store.release()
        self.encoded = {}
        if self.segment is not None:
            self.segment.close()
            self.segment = None
        super().close(handle, restore)

    def tail_bytes(self, layouts: list[BlockLayout]) -> int:
        return 0

    def stats(self, layouts: list[BlockLayout]) -> dict:
        blks = [self.encoded[l] for l in self.order if l in self.encoded]
        return dict(self.stream.stats(blks), codec_host_bytes=sum(b.store.nbytes for b in blks),
                    codec_pinned_bytes=sum(b.store.pinned_bytes for b in blks),
                    codec_shared_bytes=self.segment.nbytes if self.segment is not None else 0)
