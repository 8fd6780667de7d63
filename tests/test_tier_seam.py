"""Where a block's bytes live is one seam (runtime/tiers/): each tier one module behind one interface, the handle,
streamer, fill and layout code naming none of them, and a tier defined here, registered, streams a real diffusers
transformer bit-identically with no other edit."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("safetensors")
import diffusers  # noqa: E402

import chunkflow  # noqa: E402
from chunkflow.models.build import build_transformer  # noqa: E402
from chunkflow.models.inputs import make_inputs  # noqa: E402
from chunkflow.runtime import tiers  # noqa: E402
from chunkflow.runtime.tiers.base import ParkHome, Tier  # noqa: E402
from test_tier_structure import HELPERS, _identifiers, _imports  # noqa: E402
from chunkflow_planner.catalog import get_model  # noqa: E402
from chunkflow_planner.offload import OffloadConfig  # noqa: E402

RUNTIME = Path(chunkflow.__file__).parent / "runtime"
SEAM_USERS = ("handle.py", "streamer.py", "tensors.py", "layout.py")


def test_each_tier_is_one_module_behind_the_interface():
    assert list(tiers.TIERS)[-1] == "host"  # it takes whatever the others leave
    for registry, base in ((tiers.TIERS, Tier), (tiers.PARK_HOMES, ParkHome)):
        for name, cls in registry.items():
            assert issubclass(cls, base) and cls.name == name
            assert cls.__module__ == f"chunkflow.runtime.tiers.{name}", cls
            assert (RUNTIME / "tiers" / f"{name}.py").is_file()
    modules = {p.stem for p in (RUNTIME / "tiers").glob("*.py")} - HELPERS
    assert modules == set(tiers.TIERS) | set(tiers.PARK_HOMES)  # no module that is not a registered tier (or a helper)


def test_the_handle_streamer_fill_and_layout_name_no_tier():
    """They import no tier module (the package's registry and the interface only) and no identifier of theirs names
    a tier other than the host store they all share; the setting's own fields (OffloadConfig.disk_blocks, which the
    handle passes on to resolve the setting) are the setting's words, not code about a tier."""
    setting = set(OffloadConfig.__dataclass_fields__) if hasattr(OffloadConfig, "__dataclass_fields__") else set(
        OffloadConfig.model_fields)
    named = [n for n in tiers.TIERS if n != "host"]
    concrete = {f"chunkflow.runtime.tiers.{n}" for n in tiers.TIERS} | {"chunkflow.runtime.disk"}
    for file in SEAM_USERS:
        tree = ast.parse((RUNTIME / file).read_text())
        assert not _imports(tree) & concrete, file
        bad = {i for i in _identifiers(tree) - setting if any(n in i.lower() for n in named)}
        assert not bad, (file, bad)


def test_the_chunk_loop_asks_no_tier_per_chunk():
    """A block's source is resolved once (begin); the chunk copy reads it with no call to a tier."""
    tree = ast.parse((RUNTIME / "streamer.py").read_text())
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_copy_chunk")
    assert "tier" not in ast.unparse(fn)


class CopyTier(Tier):
    """A tier made here: every streamed block's bytes in one plain (unpageable-or-not, never pinned) tensor of its
    own, the host store keeping only the heads."""

    name = "copy"

    @classmethod
    def for_setting(cls, cfg, module, n_blocks, source):
        return cls()

    def __init__(self):
        self.at: dict[int, int] = {}
        self.buf = torch.empty(0, dtype=torch.uint8)
        self.acquired = 0

    def claim(self, b) -> bool:
        return b.is_streamed

    def laid_out(self, layouts, pin) -> None:
        off = 0
        for b in layouts:
            if b.tier is self:
                self.at[b.index] = off
                off += b.nbytes
        self.buf = torch.zeros(off, dtype=torch.uint8)

    def host_extent(self, b) -> int:
        return b.resident_bytes

    def supply(self, store, b, e, write) -> bool:
        if e.end <= b.resident_bytes:
            return False
        base = self.at[b.index]
        write(self.buf[base + e.offset: base + e.end].view(e.dtype).view(e.shape))  # the loader's or the module's
        if e.offset < b.resident_bytes:
            store.view(b.host_offset + e.offset, b.resident_bytes - e.offset).copy_(
                self.buf[base + e.offset: base + b.resident_bytes])
        return True

    def view(self, store, b, e):
        if e.end <= b.resident_bytes:
            return super().view(store, b, e)
        base = self.at[b.index]
        return torch.from_numpy(self.buf[base + e.offset: base + e.end].numpy()).view(e.dtype).view(e.shape)

    def acquire(self, store, b):
        self.acquired += 1
        return self.buf, -self.at[b.index]

    def stats(self, layouts) -> dict:
        return {}


@pytest.fixture
def copy_tier():
    tiers.register_tier(CopyTier)
    try:
        yield CopyTier
    finally:
        tiers.unregister_tier("copy")
    assert "copy" not in tiers.TIERS


def _model(name: str):
    spec = get_model(name)
    torch.manual_seed(0)
    return getattr(diffusers, spec.diffusers.cls)(**spec.diffusers.config).eval()


def _forward(m, name: str):
    kw = make_inputs(get_model(name), None, torch.float32, "cpu", seed=1)
    with torch.no_grad():
        out = m(**kw)
    return out[0] if isinstance(out, tuple) else out.sample


@pytest.mark.parametrize("name", ["tiny-wan", "tiny-flux"])
@pytest.mark.parametrize("mode,chunk,r", [("chunkflow", 1000, 0.0), ("chunkflow", 3000, 0.4), ("layerwise", None, None)])
def test_a_registered_tier_streams_bit_identically_with_no_other_edit(copy_tier, name, mode, chunk, r):
    m = _model(name)
    want = _forward(m, name)
    state = {k: v.clone() for k, v in m.state_dict().items()}
    h = chunkflow.offload(m, mode=mode, chunk_size=chunk, residency=r, device="cpu")
    streamed = [b for b in h.layouts if b.is_streamed]
    assert streamed and all(b.tier.name == "copy" for b in streamed)
    assert h.stats().host_bytes < h.stats().bytes_offloaded  # the tails are not in the host store
    tier = streamed[0].tier
    for _ in range(3):
        assert torch.equal(_forward(m, name), want)
    assert tier.acquired >= 3 * len(streamed)  # its source is what the chunks were copied from
    got = m.state_dict()  # outside the forward every tensor has its values: the tier's views
    assert all(torch.equal(got[k], v) for k, v in state.items())
    h.remove()
    assert torch.equal(_forward(m, name), want)


def test_a_registered_tier_mixes_with_the_disk_tier_and_takes_written_blocks(copy_tier, tmp_path):
    """Blocks on disk where the setting says, the registered tier takes the others before the host store; a write
    moves a disk block to the next tier that claims it, with the values written."""
    from chunkflow.runtime.disk import DiskTierWarning

    ref = _model("tiny-wan")
    ref.save_pretrained(tmp_path / "w", safe_serialization=True, max_shard_size="30KB")
    want = _forward(ref, "tiny-wan")
    m, h = build_transformer("tiny-wan", weights=tmp_path / "w", dtype=torch.float32, device="cpu",
                             config=OffloadConfig("chunkflow", 1000, 0.0, disk_blocks=1))
    assert sorted(b.tier.name for b in h.layouts) == ["copy", "disk"]
    for _ in range(2):
        assert torch.equal(_forward(m, "tiny-wan"), want)
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(0.5)
    with pytest.warns(DiskTierWarning):
        m.load_state_dict(ref.state_dict())
        got = _forward(m, "tiny-wan")
    assert torch.equal(got, _forward(ref, "tiny-wan"))
    assert [b.tier.name for b in h.layouts] == ["copy", "copy"] and h.stats().disk_blocks == 0
    h.remove()


def test_a_tier_registered_by_name_is_found_by_its_module():
    """`register_tier` keeps the host tier last whatever the order of registration."""
    tiers.register_tier(CopyTier)
    try:
        assert list(tiers.TIERS)[-1] == "host" and "copy" in tiers.TIERS
        with pytest.raises(ValueError):
            tiers.unregister_tier("host")
    finally:
        tiers.unregister_tier("copy")
    assert importlib.import_module("chunkflow.runtime.disk").DiskTierError  # the old import path still works
