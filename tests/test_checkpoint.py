"""Real checkpoint folders written with save_pretrained (unsharded, sharded, an fp16 variant, a Hugging Face cache of
blobs and symlinked snapshots) load into the plan's places once: the latents are diffusers' own from the same
folder, tied weights stay tied for every catalog text encoder, the page cache keeps none of what the load read,
every component is checked before anything is read, and the load is in the report against the plan."""

from __future__ import annotations

import dataclasses

import json
import os
import shutil
import types
from pathlib import Path

import pytest
import torch

from pipelines import as_hub_cache, one_thread, save_catalog_pipeline, tiny_pipeline

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from chunkflow.loading.pagecache import resident_pages  # noqa: E402
from chunkflow_planner.checkpoint import CheckpointError, pipeline_read_bytes  # noqa: E402
from chunkflow_planner.catalog import get_model  # noqa: E402
from chunkflow_planner.offload import DISK_RING_BLOCKS  # noqa: E402

PROMPT, NEGATIVE = "a cat walks on the grass", "blurry, low quality"
REPO = "someone/tiny-wan"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The tiny Wan pipeline saved four ways (the same weights but for the variant's own)."""
    root = tmp_path_factory.mktemp("checkpoints")
    out = {"plain": save_catalog_pipeline("tiny", root / "plain"),
           "sharded": save_catalog_pipeline("tiny", root / "sharded", max_shard_size="20KB")}
    save_catalog_pipeline("tiny", root / "variant")
    save_catalog_pipeline("tiny", root / "variant", seed=4, dtype=torch.float16, variant="fp16")
    out["variant"] = root / "variant"
    out["cache"] = as_hub_cache(out["plain"], root / "hub", REPO)
    return out


def _copy(folder: Path, to: Path) -> Path:
    shutil.copytree(folder, to)
    return to


def _reference(folder: Path, seed: int, variant: str | None = None) -> torch.Tensor:
    """diffusers alone: from_pretrained in the dtypes chunkflow runs (bf16; the Wan VAE fp32), the same call."""
    import diffusers

    pipe = diffusers.WanPipeline.from_pretrained(folder, torch_dtype={"default": torch.bfloat16, "vae": torch.float32},
                                                 variant=variant)
    pipe.set_progress_bar_config(disable=True)
    w = get_model("tiny").default_workload
    with torch.no_grad(), one_thread():
        return pipe(prompt=PROMPT, negative_prompt=NEGATIVE, height=w.height, width=w.width, num_frames=w.frames,
                    num_inference_steps=2, guidance_scale=5.0, max_sequence_length=8, output_type="latent",
                    generator=torch.Generator("cpu").manual_seed(seed)).frames


def _plan(cli, placements: dict[str, str] | None = None, *extra) -> Path:
    result = cli("plan", "--model", "tiny", "--hardware", "cpu", "--host-mem-budget", "8GB", "--out", "plan.json",
                 *extra)
    assert result.exit_code == 0, result.output
    if placements:
        plan = json.loads(Path("plan.json").read_text())
        for c in plan["pipeline"]["components"]:
            c["placement"] = placements.get(c["kind"], c["placement"])
        Path("plan.json").write_text(json.dumps(plan))
    return Path("plan.json")


# ------------------------------------------------------------------------------------------------ layouts


@pytest.mark.parametrize("layout", ["plain", "sharded", "variant", "cache"])
def test_every_layout_gives_diffusers_latents_and_reports_its_load(cli, workdir, folders, monkeypatch, layout):
    folder = folders[layout]
    variant = "fp16" if layout == "variant" else None
    weights = str(folder)
    if layout == "cache":
        monkeypatch.setenv("HF_HUB_CACHE", str(folder.parents[2]))
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        weights = REPO
    plan = _plan(cli, {"text_encoder": "stream", "transformer": "stream"})
    args = ["run", "--plan", plan, "--weights", weights, "--prompt", PROMPT, "--negative-prompt", NEGATIVE,
            "--seed", "11", "--latents", "l.safetensors", "--report", "r.json", "--mode", "chunkflow",
            "--chunk-size", "16KB", "--residency", "0.3"] + (["--variant", variant] if variant else [])
    with one_thread():
        result = cli(*args)
    assert result.exit_code == 0, result.output
    ours = load_file("l.safetensors")["latents"]
    assert torch.equal(ours, _reference(folder, 11, variant))
    load = json.loads(Path("r.json").read_text())["generation"]["load"]
    spec = get_model("tiny")
    assert load["read_bytes"] == pipeline_read_bytes(folder, spec, variant) > 0
    assert load["measured_time_s"] > 0 and 0 <= load["cached_fraction"] <= 1
    assert load["variant"] == variant and load["weights"] != "random"
    planned = load["planned_component_bytes"]
    assert load["component_bytes"] == planned  # every component holds what the plan counted, once
    assert "load:" in result.output and "read" in result.output


@pytest.mark.parametrize("layout", ["plain", "cache"])
def test_a_run_reports_each_disk_components_reads_a_generation(cli, workdir, folders, monkeypatch, layout):
    """Components the plan leaves on disk, from a saved folder or a Hugging Face cache (whose files are links to its
    blobs): the report gives what each read from its files in one measured generation (not the load's or a warm-up's
    reads), beside what the plan says, and the latents are those of diffusers."""
    weights = str(folders["plain"])
    if layout == "cache":
        monkeypatch.setenv("HF_HUB_CACHE", str(folders["cache"].parents[2]))
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        weights = REPO
    plan = _plan(cli, {"text_encoder": "disk", "vae": "disk", "transformer": "stream"})
    data = json.loads(Path(plan).read_text())
    for c in data["pipeline"]["components"]:
        c["disk_read_bytes"] = 1000 if c["placement"] == "disk" else 0
    Path(plan).write_text(json.dumps(data))
    reads = {}
    for repeat in ("1", "2"):
        with one_thread():
            result = cli("run", "--plan", plan, "--weights", weights, "--prompt", PROMPT,
                         "--negative-prompt", NEGATIVE, "--seed", "11", "--latents", "l.safetensors", "--report",
                         "r.json", "--warmup", "1", "--repeat", repeat)
        assert result.exit_code == 0, result.output
        assert torch.equal(load_file("l.safetensors")["latents"], _reference(folders["plain"], 11))
        gen = json.loads(Path("r.json").read_text())["generation"]
        reads[repeat] = gen["disk_read_bytes"]
        assert gen["predicted_disk_read_bytes"] == {"text_encoder": 1000, "vae": 1000}
    assert set(reads["1"]) == {"text_encoder", "vae"} and all(n > 0 for n in reads["1"].values())
    # a generation's reads, whatever the number of generations measured: the VAE's exactly; the text encoder's up to
    # what its reader read ahead (the ring and the next forward's first layer) before the phase's end parked it
    te = get_model("tiny").pipeline.text_encoders[0]
    ahead = (DISK_RING_BLOCKS + 1) * te.layer_params * te.dtype_bytes
    assert reads["2"]["vae"] == reads["1"]["vae"]
    assert abs(reads["2"]["text_encoder"] - reads["1"]["text_encoder"]) <= ahead
    assert "read from the checkpoint's files a generation, planned" in result.output


def test_a_plan_with_a_component_on_disk_needs_the_folder(cli, workdir):
    plan = _plan(cli, {"text_encoder": "disk"})
    result = cli("run", "--plan", plan, "--prompt", PROMPT)
    assert result.exit_code == 2 and "text_encoder" in result.output and "--weights DIR" in result.output
    assert "load" not in result.output  # refused before anything is built


def test_variant_pipeline_differs_from_its_default_weights(folders):
    assert not torch.equal(_reference(folders["variant"], 1, "fp16"), _reference(folders["variant"], 1))


def test_the_plan_reads_the_folders_headers_without_torch(workdir, folders):
    """`plan --weights` takes the bytes its load reads from the files' headers (the fp16 variant's, which keep the
    classes' fp32 modules in fp32, are not the default bf16 files'), and planning still imports no torch."""
    import subprocess
    import sys

    code = ("import sys, json; from chunkflow.commands.cli import main; sys.argv = ['chunkflow', 'plan', '--model', 'tiny', "
            f"'--hardware', 'cpu', '--weights', {str(folders['variant'])!r}, '--variant', 'fp16', '--json'];\n"
            "import io, contextlib\nbuf = io.StringIO()\n"
            "with contextlib.redirect_stdout(buf):\n"
            "    try: main()\n    except SystemExit: pass\n"
            "print(json.loads(buf.getvalue())['prediction']['load']['read_bytes'], 'torch' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    read, imported = p.stdout.split()
    spec = get_model("tiny")
    assert int(read) == pipeline_read_bytes(folders["variant"], spec, "fp16") != pipeline_read_bytes(folders["variant"], spec)
    assert imported == "False"


# --------------------------------------------------------------------------------------------- tied weights


def _tie_groups(module: torch.nn.Module) -> list[tuple[str, ...]]:
    groups: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        groups.setdefault(p.data_ptr(), []).append(name)
    return sorted(tuple(sorted(g)) for g in groups.values())


@pytest.mark.parametrize("kind", ["wan", "flux", "qwen", "hunyuan"])
def test_every_catalog_text_encoder_loads_as_transformers_does(tmp_path, kind):
    """Each catalog text encoder class (UMT5, T5, CLIP, Qwen2.5-VL, Llama), saved with save_pretrained and read by
    chunkflow's loader, holds the values transformers' from_pretrained gives and the same tied weights: one
    storage for the names the class ties (UMT5's `shared` and `encoder.embed_tokens`)."""
    import transformers

    from chunkflow.loading.reader import FileReader
    from chunkflow.loading.source import CheckpointSource
    from chunkflow.models.components import meta_text_encoder
    from chunkflow.runtime.handle import offload
    from chunkflow_planner.checkpoint import TRANSFORMERS_STEM, open_checkpoint

    pipe = tiny_pipeline(kind)
    for name in ("text_encoder", "text_encoder_2"):
        model = getattr(pipe, name, None)
        if model is None:
            continue
        folder = tmp_path / kind / name
        model.save_pretrained(folder)
        cls = type(model).__name__
        ref = getattr(transformers, cls).from_pretrained(folder, dtype=torch.bfloat16)
        cfg = json.loads((folder / "config.json").read_text())
        ours = meta_text_encoder(types.SimpleNamespace(cls=cls, config=None), torch.bfloat16, cfg)
        with FileReader() as reader:
            source = CheckpointSource(open_checkpoint(folder, TRANSFORMERS_STEM), ours, reader, name)
            handle = offload(ours, "none", device="cpu", source=source)
        assert _tie_groups(ours) == _tie_groups(ref), cls
        want = dict(ref.named_parameters(remove_duplicate=False))
        for n, p in ours.named_parameters(remove_duplicate=False):
            assert p.dtype == want[n].dtype and torch.equal(p, want[n]), (cls, n)
        if cls in ("UMT5EncoderModel", "T5EncoderModel"):
            assert ours.shared.weight.data_ptr() == ours.encoder.embed_tokens.weight.data_ptr()
        handle.remove()


def _resave(folder: Path, file: str, rename) -> None:
    sd = load_file(str(folder / file))
    save_file({rename(k): v for k, v in sd.items()}, str(folder / file), metadata={"format": "pt"})


@pytest.mark.parametrize("kind, component, old", [
    ("flux", "text_encoder", lambda k: "text_model." + k),  # CLIP as saved before transformers 5
    ("qwen", "text_encoder", lambda k: k.replace("model.language_model.", "model.").replace("model.visual.", "visual.")),
])
def test_older_checkpoint_names_are_renamed_as_transformers_does(tmp_path, kind, component, old):
    import transformers

    from chunkflow.loading.reader import FileReader
    from chunkflow.loading.source import CheckpointSource
    from chunkflow.models.components import meta_text_encoder
    from chunkflow.runtime.handle import offload
    from chunkflow_planner.checkpoint import TRANSFORMERS_STEM, open_checkpoint

    model = getattr(tiny_pipeline(kind), component)
    folder = tmp_path / component
    model.save_pretrained(folder)
    _resave(folder, "model.safetensors", old)
    cls = type(model).__name__
    ref = getattr(transformers, cls).from_pretrained(folder, dtype=torch.bfloat16)
    cfg = json.loads((folder / "config.json").read_text())
    ours = meta_text_encoder(types.SimpleNamespace(cls=cls, config=None), torch.bfloat16, cfg)
    with FileReader() as reader:
        handle = offload(ours, "none", device="cpu",
                         source=CheckpointSource(open_checkpoint(folder, TRANSFORMERS_STEM), ours, reader, component))
    want = dict(ref.named_parameters(remove_duplicate=False))
    assert all(torch.equal(p, want[n]) for n, p in ours.named_parameters(remove_duplicate=False))
    handle.remove()


# --------------------------------------------------------------------------------------------- page cache


def _cached_share(folder: Path) -> float:
    files = [p for p in Path(folder).rglob("*.safetensors")]
    cached = total = 0
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        vec = resident_pages(fd, f.stat().st_size)
        os.close(fd)
        if vec is None:
            pytest.skip("mincore is not available here")
        cached, total = cached + sum(vec), total + len(vec)
    return cached / total


def _drop(folder: Path) -> None:
    from chunkflow.loading.pagecache import drop

    for f in Path(folder).rglob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        drop(fd)
        os.close(fd)


def test_the_load_leaves_nothing_of_its_reads_in_the_page_cache(tmp_path, folders):
    """Files the page cache did not hold are read and their pages dropped after (the process and its cgroup hold
    the weights once); files it held before stay there, and the report says how much was cached."""
    from chunkflow.models.pipeline_build import build_pipeline
    from chunkflow.loading.pagecache import can_drop
    from chunkflow_planner.offload import OffloadConfig

    if not can_drop():
        pytest.skip("posix_fadvise is not available here")
    folder = _copy(folders["sharded"], tmp_path / "p")
    os.sync()
    _drop(folder)
    if _cached_share(folder) > 0.05:
        pytest.skip("this filesystem keeps the pages (tmpfs?)")
    spec = get_model("tiny")
    place = {"text_encoder": "phase", "transformer": "stream", "vae": "gpu"}
    cfg = OffloadConfig("chunkflow", "16KB", 0.0)
    with one_thread():
        built = build_pipeline(spec, place, cfg, torch.device("cpu"), weights=folder)
    assert built.load.read_bytes > 0 and built.load.cached_bytes < 0.05 * built.load.read_bytes
    built.discard()
    assert _cached_share(folder) < 0.05
    for f in folder.rglob("*.safetensors"):  # a user's own read: those pages were there first
        f.read_bytes()
    with one_thread():
        built = build_pipeline(spec, place, cfg, torch.device("cpu"), weights=folder)
    assert built.load.cached_bytes == built.load.read_bytes
    built.discard()
    assert _cached_share(folder) > 0.95


# -------------------------------------------------------------------------------- checked before any work


def _edit(folder: Path, component: str, fn) -> None:
    files = sorted((folder / component).glob("*.safetensors"))
    sd = load_file(str(files[0]))
    save_file(fn(sd), str(files[0]), metadata={"format": "pt"})


def _t5_in_umt5s_slot(folder: Path) -> None:
    model = tiny_pipeline("flux").text_encoder_2  # a T5EncoderModel
    shutil.rmtree(folder / "text_encoder")
    model.save_pretrained(folder / "text_encoder")


def _bin_text_encoder(folder: Path) -> None:
    f = next((folder / "text_encoder").glob("*.safetensors"))
    torch.save(load_file(str(f)), folder / "text_encoder" / "pytorch_model.bin")
    f.unlink()


def _wider_vae(folder: Path) -> None:
    cfg_path = folder / "vae" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_dim"] = 8
    cfg_path.write_text(json.dumps(cfg))


def _model_index(folder: Path, fn) -> None:
    path = folder / "model_index.json"
    path.write_text(json.dumps(fn(json.loads(path.read_text()))))


def _interrupted_download(folder: Path) -> None:
    snap = folder  # a cache snapshot: its text encoder's blob still downloading
    link = next((snap / "text_encoder").glob("*.safetensors"))
    blob = link.resolve()
    blob.rename(blob.with_name(blob.name + ".incomplete"))


BROKEN = [
    ("missing tensor", lambda f: _edit(f, "text_encoder", lambda sd: {k: v for k, v in sd.items()
                                                                        if k != "encoder.final_layer_norm.weight"}),
     "lacks tensor(s) encoder.final_layer_norm.weight"),
    ("extra tensor", lambda f: _edit(f, "text_encoder", lambda sd: {**sd, "decoder.block.0.x.weight": torch.ones(2)}),
     "does not have: decoder.block.0.x.weight"),
    ("other shape", lambda f: _edit(f, "text_encoder", lambda sd: {**sd, "encoder.final_layer_norm.weight":
                                                                   torch.ones(7)}), "has shape [7]"),
    ("T5 in UMT5's slot", _t5_in_umt5s_slot, "holds a T5EncoderModel"),
    ("pickled text encoder", _bin_text_encoder, "safe_serialization=True"),
    ("VAE of another size", _wider_vae, "base_dim: catalog 4, file 8"),
    ("no VAE folder", lambda f: shutil.rmtree(f / "vae"), "has no vae/ folder"),
    ("model_index names another class", lambda f: _model_index(f, lambda d: {**d, "text_encoder":
                                                                             ["transformers", "T5EncoderModel"]}),
     "makes text_encoder a T5EncoderModel"),
    ("unknown scheduler class", lambda f: _model_index(f, lambda d: {**d, "scheduler": ["diffusers", "NoSuch"]}),
     "scheduler class 'NoSuch'"),
    ("no scheduler config", lambda f: (f / "scheduler" / "scheduler_config.json").unlink(),
     "has no scheduler_config.json"),
    ("truncated text encoder", lambda f: next((f / "text_encoder").glob("*.safetensors")).write_bytes(b"\x10\x00"),
     "not a readable safetensors file"),
]


@pytest.mark.parametrize("what, damage, message", BROKEN, ids=[b[0] for b in BROKEN])
def test_a_broken_folder_is_refused_before_anything_is_read(cli, workdir, folders, monkeypatch, what, damage, message):
    from chunkflow.loading.reader import FileReader
    from chunkflow.models.pipeline_build import build_pipeline
    from chunkflow_planner.offload import OffloadConfig

    folder = _copy(folders["plain"], workdir / "broken")
    damage(folder)
    reads = []
    real = FileReader.read_into
    monkeypatch.setattr(FileReader, "read_into", lambda self, *a, **k: (reads.append(a[0]), real(self, *a, **k)))
    spec = get_model("tiny")
    with pytest.raises(CheckpointError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        build_pipeline(spec, {"transformer": "gpu"}, OffloadConfig("none"), torch.device("cpu"), weights=folder)
    assert reads == []  # refused from the folder's configs and headers alone
    plan = _plan(cli)
    result = cli("run", "--plan", plan, "--weights", folder, "--prompt", "a cat")
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()) and "Traceback" not in result.output


def test_an_interrupted_download_says_how_to_finish_it(cli, workdir, folders, monkeypatch):
    root = workdir / "hub"
    snap = as_hub_cache(folders["plain"], root, REPO)
    _interrupted_download(snap)
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = cli("run", "--plan", _plan(cli), "--weights", str(snap), "--prompt", "a cat")
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and "interrupted Hugging Face download" in said and "Traceback" not in said


def test_model_index_settings_the_pipeline_does_not_take_are_left_out(cli, workdir, folders):
    folder = _copy(folders["plain"], workdir / "extra")
    _model_index(folder, lambda d: {**d, "made_up_setting": 3})
    with one_thread():
        result = cli("run", "--plan", _plan(cli), "--weights", folder, "--prompt", "a cat", "--steps", "1")
    assert result.exit_code == 0, result.output


# ----------------------------------------------------------------------------------------- load model


def test_the_load_model_prices_reads_copies_and_new_memory():
    """eq. L1-L2: a cold load reads at the disk's rate, a warm one at the page cache's, a half-cached one at their
    harmonic mix; copies to the device, page-locking and new memory add their bytes at their rates."""
    from chunkflow_planner.catalog import get_hardware
    from chunkflow_planner.pipeline.load import BW_read, LoadEstimate, T_load, load_parts

    hw = get_hardware("h200").model_copy(update={"disk_read_gbps": 2.0, "page_cache_gbps": 8.0, "pin_gbps": 20.0,
                                                 "host_fault_gbps": 4.0, "load_startup_s": 3.0})
    est = LoadEstimate(read_bytes=16e9, h2d_bytes=hw.h2d_gbps * 1e9, pinned_bytes=20e9, host_peak_bytes=0,
                       fresh_bytes=4e9)
    assert BW_read(0.0, hw) == pytest.approx(2e9) and BW_read(1.0, hw) == pytest.approx(8e9)
    assert BW_read(0.5, hw) == pytest.approx(1 / (0.5 / 8e9 + 0.5 / 2e9))
    assert T_load(est, 0.0, hw) == pytest.approx(3.0 + 8.0 + 1.0 + 1.0 + 1.0)
    assert T_load(est, 1.0, hw) == pytest.approx(3.0 + 2.0 + 1.0 + 1.0 + 1.0)
    assert set(load_parts(est, 0.0, hw)) == {"startup", "read", "to device", "pin", "new memory"}
    assert T_load(est, 0.0, get_hardware("h200")) is None  # no disk rate measured: not predicted
    # host stores locked while their blocks are read: the reads hide the locking, until the locking is the longer
    stores = dataclasses.replace(est, pinned_while_reading=16e9)  # 0.8 s of 1.0 s of locking overlaps the reads
    assert T_load(stores, 0.0, hw) == pytest.approx(3.0 + 8.0 + 1.0 + 0.2 + 1.0)
    slow_pin = hw.model_copy(update={"pin_gbps": 1.0})  # 16 s of locking under 8 s (cold) or 2 s (warm) of reads
    assert T_load(stores, 0.0, slow_pin) == pytest.approx(3.0 + 16.0 + 1.0 + 4.0 + 1.0)
    assert T_load(stores, 1.0, slow_pin) == pytest.approx(3.0 + 16.0 + 1.0 + 4.0 + 1.0)
    over = dataclasses.replace(est, pinned_while_reading=40e9)  # never more than what is page-locked
    assert T_load(over, 0.0, hw) == pytest.approx(3.0 + 8.0 + 1.0 + 0.0 + 1.0)


def test_a_plan_predicts_its_load_from_the_profile(cli, workdir):
    """The plan's load: cold and warm times from the profile's rates, what it reads, copies, page-locks and holds;
    a profile without a disk rate says how to measure one."""
    import yaml

    from chunkflow_planner.catalog import get_hardware

    hw = get_hardware("h200").model_dump(mode="json")
    hw.update(name="h200-disk", disk_read_gbps=2.0, page_cache_gbps=8.0, pin_gbps=20.0, host_fault_gbps=4.0)
    Path("h200-disk.yaml").write_text(yaml.safe_dump(hw))
    ok = cli("plan", "--model", "wan2.2", "--frames", "41", "--height", "480", "--width", "832", "--steps", "4",
             "--mem-budget", "8GB", "--host-mem-budget", "64GB", "--hardware", "h200-disk.yaml", "--json")
    assert ok.exit_code == 0, ok.output
    p = json.loads(ok.output)
    load = p["prediction"]["load"]
    spec = get_model("wan2.2")
    total = sum(c["bytes"] for c in p["pipeline"]["components"])
    assert load["read_bytes"] == total
    assert load["time_cold_s"] > load["time_warm_s"] > 0
    assert load["time_cold_s"] - load["time_warm_s"] == pytest.approx(total / 2e9 - total / 8e9, rel=1e-6)
    assert 0 < load["host_peak_bytes"] <= p["prediction"]["host_memory_bytes"] + 2**28
    assert load["pinned_bytes"] > 0 and load["h2d_bytes"] > 0
    assert spec.pipeline is not None
    plain = cli("plan", "--model", "wan2.2", "--frames", "41", "--height", "480", "--width", "832", "--steps", "4",
                "--mem-budget", "8GB", "--host-mem-budget", "64GB", "--hardware", "h200")
    assert plain.exit_code == 0 and "calibrate --weights" in " ".join(plain.output.split())


def test_refit_measures_the_loads_start_up_and_the_processs_host_memory(cli, workdir, folders):
    """A generation report's load and host peak, with known gaps: `calibrate --from-report`'s refit finds the load's
    start-up (eq. L1 less its reads) and the process's own host memory (its peak less the plan's other bytes)."""
    from chunkflow.commands.calibrate.refit import refit_load
    from chunkflow.reports import load_reports
    from chunkflow_planner.catalog import get_hardware
    from chunkflow_planner.pipeline.load import LoadEstimate, T_load

    with one_thread():
        result = cli("run", "--plan", _plan(cli), "--weights", folders["plain"], "--prompt", "a cat", "--steps", "1",
                     "--report", "r.json")
    assert result.exit_code == 0, result.output
    hw = get_hardware("cpu").model_copy(update={"disk_read_gbps": 1.0, "page_cache_gbps": 4.0,
                                                "host_fault_gbps": 2.0})
    data = json.loads(Path("r.json").read_text())
    ld, lp = data["generation"]["load"], data["plan"]["prediction"]["load"]
    est = LoadEstimate(ld["read_bytes"], lp["h2d_bytes"], lp["pinned_bytes"], lp["host_peak_bytes"], lp["fresh_bytes"])
    ld["measured_time_s"] = T_load(est, ld["cached_fraction"], hw) + 1.25
    others = sum(v for k, v in data["plan"]["prediction"]["host_memory"].items() if k != "process")
    data["generation"]["host_peak_bytes"] = int(others + 7e8)
    Path("r.json").write_text(json.dumps(data))
    update = refit_load(hw, load_reports(["r.json"]))
    assert update["load_startup_s"] == pytest.approx(1.25, rel=1e-6)
    assert update["process_host_bytes"] == pytest.approx(7e8, abs=2)


def test_calibrate_times_the_disk_cold_and_warm(tmp_path):
    """The disk a folder is on, read by the loader's own reader: cold and from the page cache, and new memory's
    first touch; an empty folder gets a temporary sample, removed after."""
    from chunkflow.commands.calibrate.disk import measure_disk, measure_fault

    folder = tmp_path / "w"
    folder.mkdir()
    save_file({"x": torch.zeros(2**22)}, str(folder / "a.safetensors"))
    d = measure_disk(folder, sample_bytes=2**25)
    assert d["page_cache_gbps"] > 0 and d["sample_bytes"] == (folder / "a.safetensors").stat().st_size
    assert d["disk_read_gbps"] is None or d["disk_read_gbps"] > 0
    empty = tmp_path / "empty"
    empty.mkdir()
    d = measure_disk(empty, sample_bytes=2**23)
    assert d["temporary"] and d["sample_bytes"] == 2**23 and list(empty.iterdir()) == []
    assert measure_fault(2**24) > 0


def test_calibrate_prices_the_disk_at_the_rate_a_long_read_keeps():
    """A disk that reads its first half from a burst allowance is priced at its second half's rate (what a full
    checkpoint load sees), one that keeps its rate at the whole sample's, and the sample is large enough to see a
    burst of a few gigabytes."""
    from chunkflow.commands.calibrate.disk import SAMPLE_BYTES, TEMP_SAMPLE_BYTES, sustained_gbps

    n = 8 * 10**9
    assert sustained_gbps(n, seconds=4 / 2.0 + 4 / 1.2, tail_bytes=n // 2, tail_s=4 / 1.2) == pytest.approx(1.2)
    assert sustained_gbps(n, seconds=8 / 1.5, tail_bytes=n // 2, tail_s=4 / 1.5) == pytest.approx(1.5)
    assert SAMPLE_BYTES >= 8 * 10**9 and TEMP_SAMPLE_BYTES <= 2 * 10**9


# ------------------------------------------------------------------------------------------- host memory


def _subprocess_run(*args: str, cwd: Path) -> None:
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, "-m", "chunkflow", *args], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]


@pytest.mark.slow
def test_a_loaded_pipeline_holds_its_weights_once(tmp_path, monkeypatch):
    """In a process of its own, `run --weights` of the medium pipeline (a 309 MB text encoder) peaks within 10% of
    the plan's host figure, in three placements of its text encoder: the process's own memory measured
    first from the tiny pipeline's run on this machine (`calibrate --from-report`'s refit), the rest the plan's."""
    import yaml

    from chunkflow.commands.calibrate.refit import refit_load
    from chunkflow.reports import load_reports
    from chunkflow_planner.catalog import get_hardware

    monkeypatch.setenv("CHUNKFLOW_CONFIG_DIR", str(tmp_path / "config"))
    tiny = save_catalog_pipeline("tiny", tmp_path / "tiny")
    medium = save_catalog_pipeline("medium", tmp_path / "medium", max_shard_size="100MB")
    assert len(list((medium / "text_encoder").glob("*.safetensors"))) > 2  # sharded
    _subprocess_run("plan", "--model", "tiny", "--hardware", "cpu", "--out", "tiny.json", cwd=tmp_path)
    _subprocess_run("run", "--plan", "tiny.json", "--weights", str(tiny), "--prompt", PROMPT, "--report", "t.json",
                    cwd=tmp_path)
    process = refit_load(get_hardware("cpu"), load_reports([tmp_path / "t.json"]))["process_host_bytes"]
    seen = set()
    # the text encoder on the CPU; then, with a CPU too slow for it, kept on the 'device' or streamed from the host
    for update, budget in (({}, "16GB"), ({"cpu_tflops": 0.001}, "16GB"), ({"cpu_tflops": 0.001}, "300MB")):
        profile = get_hardware("cpu").model_dump(mode="json")
        profile.update(name="cpu-here", process_host_bytes=process, **update)
        (tmp_path / "cpu-here.yaml").write_text(yaml.safe_dump(profile))
        _subprocess_run("plan", "--model", "medium", "--hardware", "cpu-here.yaml", "--mem-budget", budget,
                        "--weights", str(medium), "--out", "m.json", cwd=tmp_path)
        _subprocess_run("run", "--plan", "m.json", "--weights", str(medium), "--prompt", PROMPT, "--report", "m-r.json",
                        cwd=tmp_path)
        g = json.loads((tmp_path / "m-r.json").read_text())["generation"]
        seen.add(g["components"]["text_encoder"])
        assert abs(g["host_memory_error"]) <= 0.10, (budget, g["components"], g["host_peak_bytes"],
                                                     g["predicted_host_memory_bytes"])
        assert abs(g["load"]["host_error"]) <= 0.10, g["load"]
    assert seen == {"cpu", "gpu", "stream"}


def test_the_load_model_counts_the_readers_own_threads_and_pieces():
    from chunkflow.loading import reader
    from chunkflow_planner.pipeline import load

    assert (load.READ_THREADS, load.PIECE_BYTES) == (reader.READ_THREADS, reader.PIECE_BYTES)
    assert load.STAGING_BYTES == (reader.READ_THREADS + 1) * reader.PIECE_BYTES  # the calling thread's too
