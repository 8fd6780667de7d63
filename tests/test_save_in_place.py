"""Saving an offloaded model into the folder its weights are read from (issue 51; runtime/saveguard.py), on the CPU
with tiny real models saved by save_pretrained: with the disk tier, the codec (its disk storage too) and disk
parking, `save_pretrained(its own folder)` leaves the files the model reads untouched (the save writes the same
bytes), so the model keeps running with the same outputs and state_dict; a save that would change those files is
refused before anything in the folder changes (byte for byte); a save elsewhere is a plain save."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("safetensors")

from chunkflow.runtime.disk import DiskTierError  # noqa: E402
from test_disk_tier import _build, _forward, _saved  # noqa: E402

SETTINGS = {
    "disk": dict(mode="chunkflow", chunk_bytes=1000, residency=0.0, disk_blocks=2),
    "codec": dict(mode="chunkflow", chunk_bytes=4000, residency=0.0, codec="exponent-pack"),
    "codec-disk": dict(mode="chunkflow", chunk_bytes=4000, residency=0.0, disk_blocks=2, codec="exponent-pack"),
}


def _files(folder: Path) -> dict[str, bytes]:
    """Every file under the folder, by relative name, with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _state(m) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _equal_states(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_saving_into_its_own_folder_keeps_the_model_running(tmp_path, monkeypatch, setting):
    monkeypatch.setenv("CHUNKFLOW_CACHE_DIR", str(tmp_path / "cache"))
    folder = _saved(tmp_path)
    m, h = _build(folder, **SETTINGS[setting])
    want, state = _forward(m), _state(m)
    inodes = {p.name: p.stat().st_ino for p in folder.glob("*.safetensors")}
    m.save_pretrained(folder, max_shard_size="30KB")  # as it was saved: the same bytes
    assert {p.name: p.stat().st_ino for p in folder.glob("*.safetensors")} == inodes  # never rewritten
    assert not [p for p in folder.iterdir() if p.name.startswith(".chunkflow-save")]
    for _ in range(2):
        assert torch.equal(_forward(m), want)
    assert _equal_states(_state(m), state)
    # the folder holds what a save writes: a fresh save of the same model elsewhere is byte for byte the same
    m.save_pretrained(tmp_path / "elsewhere", max_shard_size="30KB")
    assert _files(tmp_path / "elsewhere") == _files(folder)
    h.remove()
    assert "save_pretrained" not in m.__dict__  # the module as it was
    assert torch.equal(_forward(m), want)


@pytest.mark.parametrize("setting", ["disk", "codec"])
def test_a_save_that_would_change_the_files_it_reads_is_refused_and_writes_nothing(tmp_path, monkeypatch, setting):
    monkeypatch.setenv("CHUNKFLOW_CACHE_DIR", str(tmp_path / "cache"))
    folder = _saved(tmp_path)
    m, h = _build(folder, **SETTINGS[setting])
    want, state = _forward(m), _state(m)
    before = _files(folder)
    with pytest.raises(DiskTierError, match="nothing in the folder was changed") as err:
        m.save_pretrained(folder)  # unsharded: the shards it reads would go
    assert "Save into another folder, or handle.remove() first" in " ".join(str(err.value).split())
    assert _files(folder) == before
    assert torch.equal(_forward(m), want) and _equal_states(_state(m), state)
    # weights changed since load (a block's weights written: it moved to host memory, its shard would change)
    with torch.no_grad(), pytest.warns(UserWarning):
        m.load_state_dict({k: v + 1 if k.startswith("blocks.1.") else v for k, v in state.items()})
        _forward(m)
    with pytest.raises(DiskTierError, match="other bytes"):
        m.save_pretrained(folder, max_shard_size="30KB")
    assert _files(folder) == before
    _forward(m)
    # after remove() the weights live in memory: the same save goes through
    h.remove()
    m.save_pretrained(folder, max_shard_size="30KB")
    assert _files(folder) != before


def test_a_pipeline_saved_into_its_own_folder_keeps_its_disk_tier_transformer_running(tmp_path):
    """`pipe.save_pretrained(same_dir)` reaches the transformer's guarded save_pretrained through diffusers'
    pipeline: the transformer's folder is left as it is (its inode too), the model runs on."""
    from diffusers import WanPipeline

    from pipelines import save_catalog_pipeline
    from test_disk_tier import _build as build

    folder = save_catalog_pipeline("tiny", tmp_path / "pipe", 3)
    pipe = WanPipeline.from_pretrained(folder, torch_dtype=torch.bfloat16)
    m, h = build(folder / "transformer", dtype=torch.bfloat16, **SETTINGS["disk"])
    pipe.transformer = m
    want, state = _forward(m, dtype=torch.bfloat16), _state(m)
    before = _files(folder / "transformer")
    inodes = {p.name: p.stat().st_ino for p in (folder / "transformer").glob("*.safetensors")}
    pipe.save_pretrained(folder)
    assert _files(folder / "transformer") == before
    assert {p.name: p.stat().st_ino for p in (folder / "transformer").glob("*.safetensors")} == inodes
    assert torch.equal(_forward(m, dtype=torch.bfloat16), want) and _equal_states(_state(m), state)
    h.remove()


def test_a_pipeline_on_disk_saved_into_its_own_folder_runs_on(tmp_path):
    """Every component on the disk (the transformer's blocks on the disk tier, every component parked on its files):
    `built.pipe.save_pretrained(its folder)` leaves every component's weight files as they are, and the next
    generation gives the same latents."""
    from chunkflow.generate import generate
    from chunkflow_planner.catalog import get_model
    from chunkflow_planner.workload import make_workload
    from pipelines import one_thread
    from test_disk_components import run, save

    spec = get_model("tiny")
    folder = save(spec, tmp_path / "pipe")
    built, first = run(spec, folder, {"text_encoder": "disk", "transformer": "disk", "vae": "disk"})
    weights = {k: v for k, v in _files(folder).items() if k.endswith(".safetensors")}
    built.pipe.save_pretrained(folder)
    assert {k: v for k, v in _files(folder).items() if k.endswith(".safetensors")} == weights
    with one_thread():
        again = generate(built, make_workload(spec, steps=2), "a red fox in the snow", steps=2, seed=5)
    assert torch.equal(again.latents, first.latents)
    built.remove()
