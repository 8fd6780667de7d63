"""Whole components on disk (placement `disk`) and a module's non-block tensors parked in its files
(`offload(park_to="disk")`), on the CPU with real tiny pipelines saved by `save_pretrained`: every component kind on
every tier bit-identical to no offload, host memory at load and after a generation measured in a child process, the
prompt cache, and the errors and writes the disk home must not lose."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import chunkflow  # noqa: E402
from chunkflow.generate import generate  # noqa: E402
from chunkflow.models.pipeline_build import build_pipeline  # noqa: E402
from chunkflow.runtime.disk import DiskTierWarning  # noqa: E402
from chunkflow.runtime.tiers.disk import READ_PIECE  # noqa: E402
from chunkflow_planner.offload import DISK_RING_BLOCKS  # noqa: E402
from chunkflow.runtime.errors import OffloadError  # noqa: E402
from chunkflow_planner.catalog import get_model  # noqa: E402
from chunkflow_planner.offload import OffloadConfig  # noqa: E402
from chunkflow_planner.workload import make_workload  # noqa: E402
from pipelines import one_thread  # noqa: E402

CPU = torch.device("cpu")
STREAM = OffloadConfig("chunkflow", 4000, 0.0)
PROMPT = "a red fox in the snow"


def two_experts(spec):
    """The tiny Wan pipeline as Wan2.2-A14B is made: two experts, the first for the high-noise steps."""
    pipe = spec.pipeline.model_copy(update={"experts": 2, "guidance_2": 3.0, "boundary_ratio": 0.5,
                                            "config": {"boundary_ratio": 0.5}})
    return spec.model_copy(update={"pipeline": pipe})


def big_encoder(spec, vocab: int = 500_000):
    """The tiny Wan pipeline with a text encoder whose shared embedding (outside its blocks, as UMT5-XXL's 2.1 GB
    one is) is large enough for host memory to show it."""
    from chunkflow.models.components import distinct_params, meta_text_encoder

    te = spec.pipeline.text_encoders[0]
    cfg = dict(te.config, vocab_size=vocab)
    te = te.model_copy(update={"config": cfg})
    te = te.model_copy(update={"total_params": distinct_params(meta_text_encoder(te, torch.bfloat16))})
    pipe = spec.pipeline.model_copy(update={"text_encoders": [te]})
    return spec.model_copy(update={"pipeline": pipe})


def save(spec, folder: Path, seed: int = 3) -> Path:
    everything = {n: "gpu" for n in ("text_encoder", "transformer", "transformer_2", "vae")}
    with one_thread():
        built = build_pipeline(spec, everything, OffloadConfig("none"), CPU, seed=seed)
    pipe = built.pipe
    built.remove()
    pipe.save_pretrained(folder)
    return folder


def run(spec, folder: Path, placements: dict[str, str], prompt: str = PROMPT, steps: int = 2, **kw):
    with one_thread():
        built = build_pipeline(spec, placements, STREAM, CPU, weights=folder)
        gen = generate(built, make_workload(spec, steps=steps), prompt, steps=steps, seed=5, **kw)
    return built, gen


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*.safetensors")):
        h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    spec = get_model("tiny")
    folder = save(spec, tmp_path_factory.mktemp("tiny") / "w")
    built, ref = run(spec, folder, {"text_encoder": "gpu", "transformer": "gpu", "vae": "gpu"})
    built.remove()
    return spec, folder, ref


@pytest.mark.parametrize("placements", [
    {"text_encoder": "disk", "transformer": "gpu", "vae": "gpu"},
    {"text_encoder": "phase", "transformer": "stream", "vae": "disk"},
    {"text_encoder": "gpu", "transformer": "disk", "vae": "phase"},
    {"text_encoder": "disk", "transformer": "disk", "vae": "disk"},
], ids=["text-encoder", "vae", "transformer", "all"])
def test_each_component_kind_on_disk_is_bit_identical_to_no_offload(tiny, placements):
    spec, folder, ref = tiny
    before = _digest(folder)
    built, gen = run(spec, folder, placements)
    assert torch.equal(gen.latents, ref.latents)
    assert (gen.output == ref.output).all()
    on_disk = {n for n, p in placements.items() if p == "disk"}
    reads = built.disk_reads()
    assert set(reads) == on_disk and all(reads[n] > 0 for n in on_disk)  # read when they ran
    for n in on_disk:
        st = built.handles[n].stats()
        assert st.park_to == "disk" and built.handles[n].parked  # parked again after its phase
        assert st.host_bytes <= st.bytes_offloaded // 8 + 4096  # the blocks' tails are not in host memory
    assert set(built.load.disk_component_bytes) == on_disk
    # the load read none of a disk component's bytes (its files and headers checked only)
    held = sum(built.load.disk_component_bytes.values())
    allbytes = sum(built.load.component_bytes.values())
    assert built.load.read_bytes <= allbytes - held + 4096
    built.remove()
    assert _digest(folder) == before  # nothing was written to the checkpoint


def test_two_experts_on_different_tiers_match_both_on_the_device(tmp_path):
    spec = two_experts(get_model("tiny"))
    folder = save(spec, tmp_path / "a14b")
    assert (folder / "transformer_2").is_dir()
    steps = 5  # the flow-shifted schedule gives the high-noise expert most steps: in 2, the other one never ran
    built, want = run(spec, folder, {"text_encoder": "gpu", "transformer": "gpu", "transformer_2": "gpu", "vae": "gpu"},
                      steps=steps)
    built.remove()
    for placements in ({"transformer": "stream", "transformer_2": "disk"},
                       {"transformer": "disk", "transformer_2": "phase"}):
        built, got = run(spec, folder, {"text_encoder": "phase", "vae": "phase", **placements}, steps=steps)
        assert torch.equal(got.latents, want.latents), placements
        disk = next(n for n, p in placements.items() if p == "disk")
        assert set(built.disk_reads()) == {disk} and built.disk_reads()[disk] > 0
        assert built.handles[disk].stats().forwards > 0  # both experts ran (what a disk one reads, it reads running)
        assert built.handles[disk].stats().disk_blocks == len(built.handles[disk].layouts)
        built.remove()


def test_a_text_encoder_on_disk_reads_each_layer_once_a_forward_and_nothing_while_parked(tmp_path):
    """Each encode reads every layer's tail once and the parked tensors once. What the reader reads ahead for a
    forward that does not come (after the phase's last one) stops when the encoder parks: here, on the CPU, a layer's
    compute outlasts its read, so the read-ahead of the ring and the next forward's first layer finish before the
    park; on a GPU, where the layers run faster than the disk, the park cuts them short (three layers, 1.16 GB, were
    read after the park on an H200, docs/tiers-h200.md). A module built parked reads nothing until it runs."""
    spec = get_model("medium-wan")
    folder = save(spec, tmp_path / "w")
    with one_thread():
        built = build_pipeline(spec, {"text_encoder": "disk", "transformer": "gpu", "vae": "gpu"}, STREAM, CPU,
                               weights=folder)
    handle = built.handles["text_encoder"]
    tier = next(t for t in handle.tiers if t.name == "disk")
    tails = [b.nbytes - b.resident_bytes for b in handle.layouts]
    assert len(tails) == 12 and tier.bytes_read <= READ_PIECE  # the build's start of a read, cancelled at its park
    parked = handle.stats().disk_unpark_bytes_read
    for prompt in (PROMPT, PROMPT + " at dusk"):  # a new prompt each time (one encoded before is not again)
        before = built.disk_reads()["text_encoder"]
        with one_thread():
            generate(built, make_workload(spec, steps=1), prompt, steps=1, seed=5)  # the prompt and a negative one
        read = built.disk_reads()["text_encoder"] - before
        rest = handle.stats().disk_unpark_bytes_read - parked
        parked += rest
        assert rest > 0 and not tier._reads  # parked again: nothing reads ahead
        assert 2 * sum(tails) + rest <= read <= 2 * sum(tails) + rest + (DISK_RING_BLOCKS + 1) * max(tails)
    built.remove()


def test_a_prompt_already_encoded_is_not_encoded_again(tiny):
    spec, folder, ref = tiny
    with one_thread():
        built = build_pipeline(spec, {"text_encoder": "disk", "transformer": "stream", "vae": "phase"}, STREAM, CPU,
                               weights=folder)
        calls = []
        hook = built.pipe.text_encoder.register_forward_pre_hook(lambda *a: calls.append(1))
        w = make_workload(spec, steps=2)
        first = generate(built, w, PROMPT, steps=2, seed=5)
        n = len(calls)
        again = generate(built, w, PROMPT, steps=2, seed=5)
        other = generate(built, w, "a green cup", steps=2, seed=5)
        negative = generate(built, w, PROMPT, negative="blurry", steps=2, seed=5)
        hook.remove()
    assert n > 0 and not first.encode_cached
    assert again.encode_cached and len(calls) > n  # the others encoded; `again` did not
    assert torch.equal(again.latents, ref.latents) and torch.equal(first.latents, ref.latents)
    assert not other.encode_cached and not torch.equal(other.latents, ref.latents)
    assert not negative.encode_cached  # the negative prompt is part of the key
    reads = built.disk_reads()["text_encoder"]
    with one_thread():
        generate(built, w, PROMPT, steps=2, seed=5)
    assert built.disk_reads()["text_encoder"] == reads  # a cached encode reads nothing from disk
    built.remove()
    assert "encode_prompt" not in built.pipe.__dict__


def test_park_to_disk_without_files_is_a_clear_error(tiny):
    spec = tiny[0]
    from chunkflow.models.components import meta_vae
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan(**spec.pipeline.vae.config)
    before = {k: v.clone() for k, v in vae.state_dict().items()}
    with pytest.raises(OffloadError, match="no file chunkflow reads"):
        chunkflow.offload(vae, "none", device="cpu", park_to="disk")
    assert "_chunkflow_handle" not in vae.__dict__ and all(torch.equal(v, before[k]) for k, v in
                                                             vae.state_dict().items())
    with pytest.raises(OffloadError, match="park_to"):
        chunkflow.offload(vae, "none", device="cpu", park_to="tape")
    assert meta_vae  # (imported for its side effect-free build path)
    with one_thread(), pytest.raises(OffloadError, match="no file"):  # random weights: nothing on disk to read
        build_pipeline(spec, {"text_encoder": "phase", "transformer": "gpu", "vae": "disk"}, STREAM, CPU, seed=0)


def test_a_write_to_a_disk_parked_tensor_is_not_lost(tiny):
    spec, folder, _ = tiny
    before = _digest(folder)
    with one_thread():
        built = build_pipeline(spec, {"text_encoder": "phase", "transformer": "gpu", "vae": "disk"}, STREAM, CPU,
                               weights=folder)
    vae, h = built.pipe.vae, built.handles["vae"]
    p = vae.decoder.conv_in.weight
    assert h.parked and h.stats().disk_park_bytes > 0
    want = p.detach().clone()
    with torch.no_grad():  # while parked: the write lands in its private map of the file
        p.mul_(0.5)
        want.mul_(0.5)
    with pytest.warns(DiskTierWarning, match="written while parked"):
        h.unpark()
    assert torch.equal(p.detach(), want)
    with torch.no_grad():  # while on the device: the next park keeps it in host memory
        vae.decoder.conv_out.bias.add_(1.0)
    out_bias = vae.decoder.conv_out.bias.detach().clone()
    with pytest.warns(DiskTierWarning, match="changed since"):
        h.park()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DiskTierWarning)  # nothing new written: said once
        h.unpark()
        h.park()
        h.unpark()
    assert torch.equal(p.detach(), want) and torch.equal(vae.decoder.conv_out.bias.detach(), out_bias)
    h.park()
    built.remove()  # undoes everything: plain tensors with the values written, no hook left
    assert torch.equal(p.detach(), want) and torch.equal(vae.decoder.conv_out.bias.detach(), out_bias)
    assert "_hf_hook" not in vae.__dict__ and not vae._forward_pre_hooks
    assert _digest(folder) == before  # the files were never written


_RSS_CHILD = textwrap.dedent("""
    import json, pathlib, sys, torch
    sys.path.insert(0, sys.argv[3])
    from test_disk_components import big_encoder, STREAM, CPU
    from chunkflow.generate import generate
    from chunkflow.models.pipeline_build import build_pipeline
    from chunkflow_planner.catalog import get_model
    from chunkflow_planner.workload import make_workload

    def status(key):  # /proc/self/status: this process's own (VmHWM: its peak since exec)
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    torch.set_num_threads(1)
    spec = big_encoder(get_model("tiny"))
    base = status("VmRSS")
    built = build_pipeline(spec, {"text_encoder": sys.argv[2], "transformer": "gpu", "vae": "phase"}, STREAM, CPU,
                           weights=pathlib.Path(sys.argv[1]))
    load_rss, load_peak = status("VmRSS"), status("VmHWM")
    generate(built, make_workload(spec, steps=1), "a red fox", steps=1, seed=5)
    import ctypes, gc
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what the generation freed goes back to the system in both processes
    after = status("VmRSS")
    print(json.dumps({"base": base, "load_rss": load_rss, "load_peak": load_peak, "after": after,
                      "te": built.load.component_bytes["text_encoder"], "read": built.load.read_bytes}))
""")


@pytest.mark.slow
def test_host_memory_does_not_hold_a_component_on_disk(tmp_path):
    """Measured in a child process each: the same pipeline with its text encoder (a 30 MB embedding outside its
    blocks) parked in host memory (`phase`) or on disk: at the load's end and after a generation, the disk one's
    process holds nearly none of its bytes, and the load's peak did not hold them either."""
    spec = big_encoder(get_model("tiny"))
    folder = save(spec, tmp_path / "w")

    def child(where: str) -> dict:
        out = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(folder), where, str(Path(__file__).parent)],
                             capture_output=True, text=True, timeout=300,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    disk, host = child("disk"), child("phase")
    te = host["te"]
    assert te > 25e6 and disk["te"] == te
    assert host["load_rss"] - disk["load_rss"] > 0.8 * te, (disk, host)  # phase holds it, disk does not
    assert host["load_peak"] - disk["load_peak"] > 0.8 * te, (disk, host)  # nor did the load read it into memory
    assert host["read"] - disk["read"] > 0.9 * te  # the load read none of it
    assert host["after"] - disk["after"] > 0.8 * te, (disk, host)  # after it ran: parked in the files again
