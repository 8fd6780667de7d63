"""A codec as a layer over any tier: blocks whose streamed tails a tier holds encoded (OffloadConfig.codec), copied
to the device encoded and decoded there before the block runs.

Fewer bytes cross the host link and sit in pinned memory (bf16 weights: 0.70-0.75 of them with exponent-pack, docs/data/codec-trained/), the
same bytes arrive in the slot: outputs are bit for bit those without it.

- A tier only holds the encoded bytes (runtime/tiers/base.py's BlockBytes, each tier's `hold_bytes`): the host tier
  in one pinned buffer a block, the shared tier in one copy per host (local rank 0 encodes, the other local ranks
  map its bytes and encode nothing), the disk tier in a spill file read into its ring each forward.
- At layout each block's tail is read from the checkpoint's files (the loader's; never written), encoded chunk by
  chunk (on the GPU where the module runs on one: runtime/codecs/stream.py) and given to its tier; encoding is kept
  per block and layout, so laying out again only encodes blocks whose layout changed.
- A prefetch copies the encoded chunks to the device and decodes them there, a decode group at a time, on a stream of
  their own (runtime/codecs/stream.py).
- Outside its forward a tail tensor is a private copy-on-write map of its bytes in the file (runtime/tiers/files.py:
  no memory until read, the files watched for changes); a write to one, or a tensor the files lack, moves the block
  to the next tier at the next layout, where it streams as it is. So the codec needs a module loaded through
  chunkflow from its folder; without files it is refused before anything changes.

`tiers_with_codec` puts the layer over the tiers the setting uses: the disk tier's blocks encoded into its spill
file, every other streamed block encoded into the first tier in memory that holds bytes (the shared tier where the
ranks share, else the host tier); the tiers themselves stay as they are for the blocks the layer does not take.
"""

from __future__ import annotations


import torch

from chunkflow.runtime.codecs import Codec, codec_of
from chunkflow.runtime.codecs.stream import CodecStream, EncodedBlock, EncodedSource, layout_key
from chunkflow.runtime.layout import BlockLayout
from chunkflow.runtime.store import HostStore
from chunkflow.runtime.tensors import all_tensors
from chunkflow.runtime.tiers import Tier, tiers_for
from chunkflow.runtime.tiers.base import BlockBytes, ByteKind, Bytes
from chunkflow.runtime.tiers.disk import DiskTier
from chunkflow.runtime.tiers.files import FileValues, ValuesInFiles, disk_files

# the held bytes' own figures under their OffloadStats names (the disk's ring figures keep theirs)
HELD_FIELDS = {"host_bytes": "codec_host_bytes", "pinned_bytes": "codec_pinned_bytes",
               "shared_bytes": "codec_shared_bytes", "spill_bytes": "codec_spill_bytes"}


def byte_kind(codec: Codec) -> ByteKind:
    return ByteKind({"codec": codec.name}, "the codec's spill file", "the encoded disk blocks", "leave the codec off",
                    "run without the codec (--codec off)")


def tiers_with_codec(cfg, module, n_blocks: int, source) -> list[Tier]:
    """The tiers an offload with setting `cfg` uses (runtime/tiers/: tiers_for), with the codec's layer over them
    where `cfg.codec` names one (module docstring). The codec is refused before any file is opened where it cannot
    be used; without the checkpoint's files it is refused too."""
    codec = codec_of(cfg)
    tiers = tiers_for(cfg, module, n_blocks, source)
    if codec is None:
        return tiers
    kind, what = byte_kind(codec), f"codec={codec.name!r}"
    out = [CodedTier(codec, t.values, t.hold_bytes(kind), "codec_disk", f"{what} with disk_blocks")
           if isinstance(t, DiskTier) else t for t in tiers]
    at = next(i for i, t in enumerate(out) if not isinstance(t, CodedTier))
    held = next(h for t in out[at:] if (h := t.hold_bytes(kind)) is not None)
    values = FileValues(set(range(n_blocks)), disk_files(source, what),
                        "they stream from host memory as they are, not encoded")
    values.note_records(all_tensors(module))
    out.insert(at, CodedTier(codec, values, held, "codec", what))
    return out


class CodedTier(ValuesInFiles, Tier):
    """Blocks whose tails a tier holds encoded (module docstring): `values`, the checkpoint's files as their tensors'
    home outside the forward (and the blocks it takes); `held`, the tier holding their encoded bytes; `fields`, the
    prefix of its OffloadStats fields; `what`, the setting, for messages."""

    def __init__(self, codec: Codec, values: FileValues, held: BlockBytes, fields: str, what: str):
        self.codec, self.values, self.held = codec, values, held
        self.name = f"{type(held).__name__}+{codec.name}"
        self.recycles = held.recycles
        self.fields, self.what = fields, what
        self.stream = CodecStream(codec)
        self.encoded: dict[int, EncodedBlock] = {}  # block -> its tail encoded, in this layout
        self._made: dict[str, EncodedBlock] = {}  # key -> blocks encoded here (not read from another rank's rows)

    # ---- layout: the blocks' values stay in the files, their tails are encoded and given to the tier

    def claim(self, b: BlockLayout) -> bool:
        return self.values.claim(b)

    def laid_out(self, layouts: list[BlockLayout], pin: bool) -> None:
        """Check the files, then encode every block whose layout is new and give it to the tier."""
        self.values.laid_out(layouts, self)
        self.stream.set_device(pin, self.what)
        keys = {l: repr(layout_key(layouts[l])) for l in self.values.order}
        rows = self.held.keep(keys, lambda l: self._encode(layouts[l]), pin)
        self.encoded = {l: self._made.get(keys[l]) or EncodedBlock.from_row(layout_key(layouts[l]), rows[l],
                                                                           self.codec) for l in keys}
        self._made = {keys[l]: blk for l, blk in self.encoded.items()}

    def _encode(self, b: BlockLayout) -> Bytes:
        blk, pieces = self.stream.encode(b, self.values.raw_tail(b, self.stream.device))
        self._made[repr(blk.key)] = blk
        return Bytes(blk.nbytes, blk.row(), pieces)

    # ---- streaming

    def source(self, store: HostStore, b: BlockLayout, non_blocking: bool) -> EncodedSource:
        """The block's encoded bytes as its tier hands them out (waiting for a read), copied and decoded."""
        buf = self.held.acquire(b.index)
        return self.stream.source(self.encoded[b.index], buf, self._in_memory)

    def _in_memory(self) -> list[tuple[EncodedBlock, torch.Tensor | None]]:
        return [(self.encoded[l], self.held.in_memory(l)) for l in self.values.order]

    def acquire(self, store: HostStore, b: BlockLayout):
        raise AssertionError("a codec's tier gives a source (`source`), not a flat buffer")

    def prepare(self, b: BlockLayout) -> None:
        self.held.prepare(b.index)

    def pause(self) -> None:
        """Parked: what the tier brings ahead stops, and the device buffers go with the slots."""
        self.held.pause()
        self.stream.drop_device()

    def release(self, l: int, copied) -> None:
        self.held.release(l, copied)

    # ---- the handle's part

    def attach(self, handle) -> None:
        self.values.attach(handle)

    def detach(self, handle) -> None:
        self.values.detach(handle)
        self.held.detach()
        self.stream.drop_device()

    def close(self, handle, restore: bool) -> None:
        self.held.close()
        self.values.close()
        self.encoded, self._made = {}, {}

    def stats(self, layouts: list[BlockLayout]) -> dict:
        blks = [self.encoded[l] for l in self.values.order if l in self.encoded]
        out = self.stream.stats(blks, self.fields)
        out.update({HELD_FIELDS.get(field, field): n for field, n in self.held.stats().items()})
        if self.fields == "codec":
            out.update(codec=self.codec.name, codec_decode_config=self.stream.decode_config_name())
        return out
