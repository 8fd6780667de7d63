"""The codec layer over the tiers (runtime/codecs/layer.py) on the CPU, with the runtime's own code: a module whose streamed tails
are kept encoded (codec exponent-pack) gives the outputs of no offload bit for bit, alone and mixed with the disk
and host tiers, in both streaming modes; the bytes a forward copies are the encoded ones; outside the forward every
tensor has its values; writes and LoRA layers move blocks to the host tier; nothing is written to the checkpoint;
and a module without files is refused before anything changes."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("safetensors")
from diffusers import WanTransformer3DModel  # noqa: E402

import chunkflow  # noqa: E402
from chunkflow.runtime.disk import DiskTierWarning  # noqa: E402
from chunkflow.runtime.errors import OffloadError  # noqa: E402
from chunkflow_planner.catalog import get_model  # noqa: E402
from chunkflow_planner.offload import OffloadConfig, OffloadConfigError  # noqa: E402
from test_disk_tier import _build, _digest, _forward, _saved  # noqa: E402

CODEC = "exponent-pack"


@pytest.mark.parametrize("model,dtype", [("tiny-wan", torch.float32), ("demo-wan", torch.bfloat16)])
@pytest.mark.parametrize("mode,chunk,r", [("chunkflow", 4000, 0.0), ("chunkflow", 16000, 0.5), ("layerwise", None, None)])
def test_the_codec_on_every_tier_is_bit_identical_to_no_offload(tmp_path, model, dtype, mode, chunk, r, monkeypatch):
    monkeypatch.setenv("CHUNKFLOW_CACHE_DIR", str(tmp_path / "cache"))  # the disk blocks' spill file goes here
    folder = _saved(tmp_path, model, dtype, shard="2MB" if model == "demo-wan" else "30KB")
    before = _digest(folder)
    ref, h0 = _build(folder, model, dtype, mode="none")
    want = _forward(ref, model, dtype)
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    h0.remove()
    n = len(ref.blocks)
    for disk in (0, n // 2):  # every block encoded; half on disk, the rest encoded
        m, h = _build(folder, model, dtype, mode=mode, chunk_bytes=chunk, residency=r, disk_blocks=disk, codec=CODEC)
        st = h.stats()
        assert st.codec == CODEC and st.codec_blocks == n - disk and st.disk_blocks == disk == st.codec_disk_blocks
        assert st.host_bytes < st.bytes_offloaded  # the store keeps the heads only; the tails are encoded
        if disk:  # the disk blocks' tails are read encoded from the spill file (never from or into the folder)
            assert st.codec_disk_stored_bytes <= st.disk_bytes_per_step <= st.codec_spill_bytes
            assert st.disk_bytes_per_step < st.codec_disk_raw_bytes or model == "tiny-wan"
        issued = []
        for i in range(3):
            assert torch.equal(_forward(m, model, dtype), want), (disk, i)
            issued.append(h.stats().h2d_bytes_issued)
        assert st.codec_raw_bytes + st.codec_disk_raw_bytes == st.streamed_bytes_per_step
        # a forward copies the encoded bytes, of the host's blocks and the disk's
        assert issued[2] - issued[1] == st.codec_stored_bytes + st.codec_disk_stored_bytes
        if disk:
            assert h.stats().disk_bytes_read >= 2 * st.disk_bytes_per_step
        got = m.state_dict()  # outside the forward every tensor has its values (the file's, mapped)
        assert all(torch.equal(got[name], v) for name, v in state.items())
        h.remove()
        assert torch.equal(_forward(m, model, dtype), want)
    assert _digest(folder) == before  # nothing was written to the checkpoint
    assert not any((tmp_path / "cache").iterdir())  # the spill file was never a name there: gone with its handle


def test_bf16_blocks_stream_fewer_bytes_and_hold_less_host_memory(tmp_path):
    folder = _saved(tmp_path, "demo-wan", torch.bfloat16, shard="2MB")
    m, h = _build(folder, "demo-wan", torch.bfloat16, mode="chunkflow", chunk_bytes=256_000, residency=0.0,
                  codec=CODEC)
    st = h.stats()
    assert st.codec_blocks == st.n_streamed_blocks > 0
    assert st.codec_stored_bytes < 0.75 * st.codec_raw_bytes  # random bf16 (kaiming-uniform) values: about 0.7
    assert st.codec_host_bytes < 0.76 * st.codec_raw_bytes
    before = h.stats().h2d_bytes_issued
    _forward(m, "demo-wan", torch.bfloat16)
    assert h.stats().h2d_bytes_issued - before == st.codec_stored_bytes
    h.remove()


def test_a_module_without_files_is_refused_with_what_to_do():
    torch.manual_seed(0)
    m = WanTransformer3DModel(**get_model("tiny-wan").diffusers.config).eval()
    with pytest.raises(OffloadError, match="no file chunkflow reads"):
        chunkflow.offload(m, mode="chunkflow", codec=CODEC, device="cpu")
    assert "_chunkflow_hook" not in m.blocks[0].__dict__  # nothing changed


def test_a_codec_that_does_not_exist_or_fp8_storage_is_refused():
    with pytest.raises(OffloadConfigError, match="codec"):
        OffloadConfig(mode="chunkflow", codec="zip")
    with pytest.raises((OffloadConfigError, OffloadError), match="codec"):
        OffloadConfig(mode="chunkflow", codec=CODEC, weight_dtype="fp8_e4m3")


def test_load_state_dict_moves_the_written_blocks_to_host_memory(tmp_path):
    folder = _saved(tmp_path)
    before = _digest(folder)
    m, h = _build(folder, mode="chunkflow", chunk_bytes=4000, residency=0.0, codec=CODEC)
    assert h.stats().codec_blocks == len(m.blocks)
    torch.manual_seed(3)
    other = WanTransformer3DModel(**get_model("tiny-wan").diffusers.config).eval()
    with pytest.warns(DiskTierWarning, match="not encoded"):
        m.load_state_dict(other.state_dict())
        got = _forward(m)
    assert torch.equal(got, _forward(other))  # the new weights, not the file's
    assert h.stats().codec_blocks == 0
    assert torch.equal(_forward(m), _forward(other))
    assert _digest(folder) == before
    h.remove()


def test_lora_on_encoded_blocks_matches_the_same_lora_without_offload(tmp_path):
    pytest.importorskip("peft")
    from chunkflow.models.inputs import make_inputs
    from test_fidelity import _lora_lifecycle

    folder = _saved(tmp_path)
    ref, h0 = _build(folder, mode="none")
    m, h = _build(folder, mode="chunkflow", chunk_bytes=4000, residency=0.0, codec=CODEC)
    kw = make_inputs(get_model("tiny-wan"), None, torch.float32, "cpu", seed=1)
    want, got = [], []
    _lora_lifecycle(ref, kw, want)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DiskTierWarning)  # the adapter's layers are in no file: host tier
        _lora_lifecycle(m, kw, got)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and len(got) == 8
    h.remove()
    h0.remove()


def test_park_and_a_second_layout_keep_the_encoded_blocks_exact(tmp_path):
    """A park drops the device buffers and a re-layout (another chunk order after blocks ran out of order) encodes
    only what changed; the output stays exact."""
    folder = _saved(tmp_path)
    ref, h0 = _build(folder, mode="none")
    want = _forward(ref)
    h0.remove()
    m, h = _build(folder, mode="chunkflow", chunk_bytes=4000, residency=0.0, codec=CODEC)
    assert torch.equal(_forward(m), want)
    h.park()
    assert torch.equal(_forward(m), want)
    h.remove()


def test_the_host_memory_the_plan_predicts_is_what_the_encoded_tier_holds(tmp_path):
    """The planner's pinned host bytes with the codec (the heads raw, the tails at calibrate's measured ratio) against
    what the runtime holds for the same weights and setting (the store of heads plus the encoded tails)."""
    from chunkflow.commands.calibrate.codec import measure_ratio
    from chunkflow_planner.catalog import get_hardware
    from chunkflow_planner.memory import estimate_memory

    pipe = tmp_path / "pipe"
    torch.manual_seed(0)
    ref = WanTransformer3DModel(**get_model("demo-wan").diffusers.config).eval().to(torch.bfloat16)
    ref.save_pretrained(pipe / "transformer", safe_serialization=True)
    ratio = measure_ratio(pipe)["ratio"]  # what `chunkflow calibrate --weights` puts in the profile
    cfg = OffloadConfig("chunkflow", "256KB", 0.2, codec=CODEC)
    spec = get_model("demo-wan")
    hw = get_hardware("h200").model_copy(update={"codec_ratio": ratio})
    plan = estimate_memory(spec, spec.default_workload, cfg, hw=hw)
    m, h = _build(pipe / "transformer", "demo-wan", torch.bfloat16, mode="chunkflow", chunk_bytes="256KB",
                  residency=0.2, codec=CODEC)
    st = h.stats()
    assert st.codec_raw_bytes == pytest.approx(plan.codec_raw, rel=0.01)
    assert st.codec_stored_bytes == pytest.approx(plan.codec_stored, rel=0.01)
    held = st.host_bytes + st.codec_host_bytes  # heads (and alignment) + encoded tails
    assert held == pytest.approx(plan.pinned_host, rel=0.01)
    assert st.codec_stored_bytes < 0.76 * st.codec_raw_bytes
    h.remove()


def test_a_tiny_pipeline_with_the_codec_on_every_tier_gives_the_latents_of_no_codec(cli, workdir, monkeypatch):
    """`chunkflow run --plan` of a whole (tiny, bf16) pipeline saved with save_pretrained: its transformer's blocks
    on the host tier encoded and on the disk tier encoded give the latents of the same plan without the codec, bit
    for bit, from the folder and from a Hugging Face cache layout; the run's report has the codec's figures."""
    pytest.importorskip("transformers")
    from pipelines import as_hub_cache, one_thread, save_catalog_pipeline
    from safetensors.torch import load_file

    monkeypatch.setenv("CHUNKFLOW_CACHE_DIR", str(workdir / "cache"))
    folder = save_catalog_pipeline("tiny", workdir / "tiny")
    result = cli("plan", "--model", "tiny", "--hardware", "cpu", "--host-mem-budget", "8GB", "--out", "raw.json")
    assert result.exit_code == 0, result.output
    plan = json.loads(Path("raw.json").read_text())
    for c in plan["pipeline"]["components"]:
        c["placement"] = "stream" if c["kind"] == "transformer" else c["placement"]
    plan["offload"].update(mode="chunkflow", chunk_bytes=16000, residency=0.3)
    plan["hardware"]["spec"].update(disk_read_gbps=1.0, codec_decode_gbps=50.0)  # what calibrate measures
    Path("raw.json").write_text(json.dumps(plan))
    plan["offload"]["codec"] = CODEC
    Path("host.json").write_text(json.dumps(plan))
    plan["offload"]["disk_blocks"] = 1
    Path("mixed.json").write_text(json.dumps(plan))
    outs = {}
    for name in ("raw", "host", "mixed"):
        with one_thread():
            result = cli("run", "--plan", f"{name}.json", "--weights", folder, "--prompt", "a cat", "--seed", "5",
                         "--latents", f"{name}.safetensors", "--report", f"{name}-report.json")
        assert result.exit_code == 0, result.output
        outs[name] = load_file(f"{name}.safetensors")["latents"]
    assert torch.equal(outs["host"], outs["raw"]) and torch.equal(outs["mixed"], outs["raw"])
    stats = json.loads(Path("mixed-report.json").read_text())["stats"]
    assert stats["codec"] == CODEC and stats["codec_blocks"] >= 1 and stats["codec_disk_blocks"] == 1
    assert stats["disk_bytes_read"] >= stats["disk_bytes_per_step"] > 0
    # from a Hugging Face cache: the snapshot's files are symlinks to blobs, encoded and mapped through them
    as_hub_cache(folder, workdir / "hub", "someone/tiny-wan")
    monkeypatch.setenv("HF_HUB_CACHE", str(workdir / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with one_thread():
        result = cli("run", "--plan", "mixed.json", "--weights", "someone/tiny-wan", "--prompt", "a cat", "--seed", "5",
                     "--latents", "cache.safetensors")
    assert result.exit_code == 0, result.output
    assert torch.equal(load_file("cache.safetensors")["latents"], outs["raw"])


@pytest.mark.parametrize("disk", [0, 2])
def test_blocks_given_out_of_order_are_laid_out_again_with_their_own_encoded_bytes(tmp_path, disk):
    """Blocks given in another order than the forward runs them are laid out again in the order they ran
    (runtime/order.py): every block's layout is then another block's of the same shape, and each must stream its own
    encoded bytes (host and disk tier), not those its index held before; the output stays exact."""
    from chunkflow.loading.reader import FileReader
    from chunkflow.models.build import transformer_module, transformer_source

    folder = _saved(tmp_path)
    ref, h0 = _build(folder, mode="none")
    want = _forward(ref)
    h0.remove()
    spec = get_model("tiny-wan")
    module = transformer_module(spec, torch.float32)
    reader = FileReader()
    try:
        src = transformer_source(folder, spec, module, reader, None)
        h = chunkflow.offload(module, mode="chunkflow", chunk_size=4000, residency=0.0, codec=CODEC, disk_blocks=disk,
                              device="cpu", blocks=list(reversed(list(module.blocks))), source=src)
    finally:
        reader.close()
    assert torch.equal(_forward(module), want)  # the first forward, in the order given
    assert h.stats().reorders == 1
    assert torch.equal(_forward(module), want)  # laid out again in the order they ran
    assert torch.equal(_forward(module), want)
    h.remove()


@pytest.mark.parametrize("model,chunk", [("tiny-wan", 999), ("tiny-wan", 1001), ("demo-wan", 65_537)])
def test_an_odd_chunk_size_with_the_codec_is_bit_identical_to_the_same_size_without(tmp_path, model, chunk,
                                                                                      monkeypatch):
    """issue 51: an odd chunk size puts every other chunk at an odd byte, where the codec's 16-bit words could not
    be viewed (a raw torch error at the load). Such a chunk keeps its first byte as it is and encodes the rest, on
    the host tier and the disk tier's spill file alike: the same outputs and state as without the codec, bit for
    bit; chunks large enough to shrink (demo-wan's) shrink as much as at the even size next to it (the words stay
    on the tensors' own 16-bit values)."""
    monkeypatch.setenv("CHUNKFLOW_CACHE_DIR", str(tmp_path / "cache"))
    dtype = torch.bfloat16
    folder = _saved(tmp_path, model, dtype, shard="2MB" if model == "demo-wan" else "30KB")

    def ratio(st):
        return (st.codec_stored_bytes + st.codec_disk_stored_bytes) / (st.codec_raw_bytes + st.codec_disk_raw_bytes)

    for r, half in ((0.0, False), (0.5, True)):
        raw, h0 = _build(folder, model, dtype, mode="chunkflow", chunk_bytes=chunk, residency=r)
        n = len(raw.blocks)
        disk = n // 2 if half else 0
        want, state = _forward(raw, model, dtype), {k: v.clone() for k, v in raw.state_dict().items()}
        h0.remove()
        m, h = _build(folder, model, dtype, mode="chunkflow", chunk_bytes=chunk, residency=r, disk_blocks=disk,
                      codec=CODEC)
        st = h.stats()
        assert st.codec_blocks == n - disk and st.codec_disk_blocks == disk
        for _ in range(2):
            assert torch.equal(_forward(m, model, dtype), want), (chunk, r)
        got = m.state_dict()
        assert all(torch.equal(got[k], v) for k, v in state.items())
        h.remove()
        if model == "demo-wan":
            even, h2 = _build(folder, model, dtype, mode="chunkflow", chunk_bytes=chunk + 1, residency=r,
                              disk_blocks=disk, codec=CODEC)
            assert ratio(st) < 0.75 and ratio(st) < ratio(h2.stats()) + 0.005
            h2.remove()
