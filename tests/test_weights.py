"""chunkflow.weights: `--weights` as a local pipeline folder or a Hub id found in a (fake, real-layout) Hugging Face
cache, with the network unreachable throughout."""

from __future__ import annotations

import hashlib
import json
import os
import socket
from pathlib import Path

import pytest

from chunkflow.weights import WeightsError, hub_cache_dir, pipeline_class_name, pipeline_components, resolve_weights

pytest.importorskip("huggingface_hub")

MAIN = "0123456789abcdef0123456789abcdef01234567"
V2 = "fedcba9876543210fedcba9876543210fedcba98"
WAN_INDEX = {
    "_class_name": "WanPipeline",
    "_diffusers_version": "0.35.0.dev0",
    "boundary_ratio": 0.875,
    "expand_timesteps": False,
    "scheduler": ["diffusers", "UniPCMultistepScheduler"],
    "text_encoder": ["transformers", "UMT5EncoderModel"],
    "tokenizer": ["transformers", "T5TokenizerFast"],
    "transformer": ["diffusers", "WanTransformer3DModel"],
    "transformer_2": ["diffusers", "WanTransformer3DModel"],
    "vae": ["diffusers", "AutoencoderKLWan"],
    "image_encoder": [None, None],
}


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Any attempt to open a connection (or even resolve a name) fails the test."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def refuse(*args, **kwargs):
        raise AssertionError(f"network touched: {args[1:] or kwargs}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


def add_blob(repo: Path, snapshot: Path, name: str, text: str) -> None:
    """The real cache layout: the file in snapshots/<commit>/ is a relative symlink into blobs/."""
    blob = repo / "blobs" / hashlib.sha256(text.encode()).hexdigest()
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_text(text)
    target = snapshot / name
    target.parent.mkdir(parents=True, exist_ok=True)
    target.symlink_to(os.path.relpath(blob, target.parent))


def add_snapshot(cache: Path, repo_id: str, commit: str, ref: str | None, index: dict | None = WAN_INDEX) -> Path:
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    if index is not None:
        add_blob(repo, snapshot, "model_index.json", json.dumps(index))
    add_blob(repo, snapshot, "transformer/config.json", json.dumps({"_class_name": "WanTransformer3DModel"}))
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)  # as huggingface_hub writes it: the hash, no newline
    return snapshot


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    hub = tmp_path / "hf" / "hub"
    add_snapshot(hub, "org/name", MAIN, "main")
    add_snapshot(hub, "org/name", V2, "v2")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    return hub


def test_hub_id_resolves_from_the_cache(cache):
    snap = cache / "models--org--name" / "snapshots"
    assert resolve_weights("org/name") == snap / MAIN
    assert resolve_weights("org/name@main") == snap / MAIN
    assert resolve_weights(f"org/name@{MAIN}") == snap / MAIN
    assert resolve_weights("org/name@v2") == snap / V2
    assert resolve_weights(f"org/name@{V2}") == snap / V2
    assert pipeline_components(resolve_weights("org/name"))["transformer"] == ("diffusers", "WanTransformer3DModel")


def test_cache_found_through_hf_home(cache, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(cache.parent))
    assert hub_cache_dir() == cache
    assert resolve_weights("org/name") == cache / "models--org--name" / "snapshots" / MAIN


def test_uncached_id_names_the_cache_and_how_to_download(cache):
    with pytest.raises(WeightsError) as err:
        resolve_weights("other-org/Some.Model-1")
    msg = str(err.value)
    assert "not in the local Hugging Face cache" in msg and str(cache) in msg
    assert "hf download other-org/Some.Model-1" in msg and "huggingface-cli download" in msg
    assert "\n" not in msg


def test_uncached_revision_lists_what_is_cached(cache):
    with pytest.raises(WeightsError, match=r"at revision v3 \(cached: main, v2, 0123456789ab, fedcba987654\)") as err:
        resolve_weights("org/name@v3")
    assert "hf download org/name --revision v3" in str(err.value)
    with pytest.raises(WeightsError, match="not in the local Hugging Face cache"):
        resolve_weights("org/name@" + "1" * 40)


def test_cached_snapshot_without_model_index(cache):
    add_snapshot(cache, "org/single", MAIN, "main", index=None)
    with pytest.raises(WeightsError, match="not a diffusers pipeline folder \\(model_index.json missing\\)"):
        resolve_weights("org/single")


def test_cache_entry_folder_given_as_path_suggests_the_id(cache):
    with pytest.raises(WeightsError, match="pass the Hub id, --weights org/name"):
        resolve_weights(str(cache / "models--org--name"))


def test_local_pipeline_folder(tmp_path, monkeypatch):
    pipe = tmp_path / "wan"
    (pipe / "transformer").mkdir(parents=True)
    (pipe / "model_index.json").write_text(json.dumps(WAN_INDEX))
    assert resolve_weights(str(pipe)) == pipe
    monkeypatch.chdir(tmp_path)
    assert resolve_weights("wan") == pipe  # absolute, whatever the working directory
    assert resolve_weights("./wan/") == pipe
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_weights("~/wan") == pipe
    # model_index.json itself: told to give its folder
    with pytest.raises(WeightsError, match="is a file; give its folder"):
        resolve_weights(str(pipe / "model_index.json"))


def test_local_folder_without_model_index(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(WeightsError, match=r"not a diffusers pipeline folder \(model_index.json missing\)"):
        resolve_weights(str(empty))
    # a single model's folder (config.json + safetensors) inside a pipeline folder
    pipe = tmp_path / "wan"
    transformer = pipe / "transformer"
    transformer.mkdir(parents=True)
    (pipe / "model_index.json").write_text(json.dumps(WAN_INDEX))
    (transformer / "config.json").write_text("{}")
    (transformer / "diffusion_pytorch_model.safetensors").write_bytes(b"\0" * 8)
    with pytest.raises(WeightsError, match="takes the whole pipeline folder") as err:
        resolve_weights(str(transformer))
    assert repr(str(pipe)) in str(err.value)


@pytest.mark.parametrize("source", ["/nonexistent/wan", "./wan", "../wan", "~/no-such-chunkflow-dir",
                                    "models/org/name", "wan/"])
def test_missing_path_names_the_path(tmp_path, monkeypatch, source):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(WeightsError, match="no such folder") as err:
        resolve_weights(source)
    assert repr(source) in str(err.value)


@pytest.mark.parametrize("source", ["wan", "org/na me", "org/name@", "org//name", "org/-name", "org/na--me", ""])
def test_neither_folder_nor_hub_id(tmp_path, monkeypatch, cache, source):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(WeightsError):
        resolve_weights(source)


def test_pipeline_components_and_class(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps(WAN_INDEX))
    assert pipeline_class_name(tmp_path) == "WanPipeline"
    assert pipeline_components(tmp_path) == {
        "scheduler": ("diffusers", "UniPCMultistepScheduler"),
        "text_encoder": ("transformers", "UMT5EncoderModel"),
        "tokenizer": ("transformers", "T5TokenizerFast"),
        "transformer": ("diffusers", "WanTransformer3DModel"),
        "transformer_2": ("diffusers", "WanTransformer3DModel"),
        "vae": ("diffusers", "AutoencoderKLWan"),
    }


@pytest.mark.parametrize("text,match", [
    ('{"_class_name": "WanPipeline", "vae": ["diffusers", "AutoencoderKLWan"]', "not valid JSON .* line 1"),
    ('["WanPipeline"]', "holds a JSON list, not an object"),
    ('{"vae": ["diffusers", "AutoencoderKLWan"]}', "no \"_class_name\""),
    ('{"_class_name": "WanPipeline", "vae": ["diffusers"]}', "component 'vae'"),
    ('{"_class_name": "WanPipeline", "vae": ["diffusers", null]}', "component 'vae'"),
])
def test_malformed_model_index(tmp_path, text, match):
    (tmp_path / "model_index.json").write_text(text)
    with pytest.raises(WeightsError, match=match):
        pipeline_components(tmp_path)
    assert resolve_weights(str(tmp_path)) == tmp_path  # resolving only checks the file is there


def test_pipeline_components_without_model_index(tmp_path):
    with pytest.raises(WeightsError, match="model_index.json missing"):
        pipeline_components(tmp_path)


def test_network_guard_is_live():
    with pytest.raises(AssertionError, match="network touched"):
        socket.create_connection(("huggingface.co", 443))
    s = socket.socket()
    try:
        with pytest.raises(AssertionError, match="network touched"):
            s.connect(("127.0.0.1", 9))
    finally:
        s.close()
