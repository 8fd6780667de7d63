"""fp8-scaled files on every tier: a module `fp8_scaled.load` made streams its blocks from the file on disk
(`source=fp8_scaled.source(path, module)`, the file's byte ranges, as formats/gguf.GGUFSource does for GGUF); a
pipeline's fp8-scaled transformer placed on disk reads its blocks from the file (tests/test_transformer_file_experts.py
runs one expert so); under torchrun (2 ranks, gloo) `chunkflow run --transformer FILE` streams the e4m3 bytes from one
host copy the ranks share. Each bit-identical to the plain torch reference of the dequantization
(`w.to(bf16) * scale.to(bf16)`), in the model or in diffusers' pipeline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import chunkflow
from chunkflow.formats import fp8_scaled
from pipelines import one_thread
from test_fp8_scaled import BF16, CASES, E4M3, blocks_of, forward, reference


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("chunk,r,k", [(4096, 0.0, 1), (3001, 0.5, 2)])
def test_a_loaded_module_reads_its_blocks_from_the_file_on_disk(tmp_path, case, chunk, r, k):
    m, cfg, inputs, path, ref = CASES[case](tmp_path)
    want = forward(reference(m, ref), inputs)
    loaded = fp8_scaled.load(path, type(m), cfg, BF16)
    h = chunkflow.offload(loaded, mode="chunkflow", chunk_size=chunk, residency=r, device="cpu",
                          blocks=blocks_of(loaded), source=fp8_scaled.source(path, loaded), disk_blocks=k)
    st = h.stats()
    assert st.disk_blocks == k
    stored = {t.dtype for b in h.layouts for t in b.tensors if t.name.endswith("weight") and t.nbytes > 256}
    assert E4M3 in stored and not any(b.cast_tensors() for b in h.layouts)  # the file's bytes, never cast
    assert torch.equal(forward(loaded, inputs), want)  # the first forward may lay the blocks out again (their order)
    reads = [h.stats().disk_bytes_read]
    for _ in range(2):
        assert torch.equal(forward(loaded, inputs), want)
        reads.append(h.stats().disk_bytes_read)
    # read from the file at each forward: the bytes disk_bytes_per_step says (the parts held converted in host memory
    # are copied from there, not read; reads ahead are counted when a forward takes them)
    assert reads[2] - reads[1] == reads[1] - reads[0] == h.stats().disk_bytes_per_step > 0
    h.remove()
    assert torch.equal(forward(loaded, inputs), want)


def test_a_module_of_another_file_is_refused_in_one_line(tmp_path):
    """The ranges are the file's only where it is the module's model: a file for another config is refused."""
    m, cfg, _, path, _ = CASES["wan"](tmp_path)
    (tmp_path / "b").mkdir()
    mf, cfg_f, _, path_f, _ = CASES["flux"](tmp_path / "b")
    loaded = fp8_scaled.load(path, type(m), cfg, BF16)
    with pytest.raises(fp8_scaled.Fp8ScaledError) as err:
        fp8_scaled.source(path_f, loaded)
    assert path_f.name in str(err.value) and "\n" not in str(err.value)


# ------------------------------------------------------------------------------ the shared tier (torchrun)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The tiny Wan pipeline's folder, its transformer as an fp8-scaled file, and the reference transformer."""
    from file_pipelines import expert_file
    from pipelines import save_catalog_pipeline

    root = tmp_path_factory.mktemp("fp8tiers")
    with one_thread():
        folder = save_catalog_pipeline("tiny", root / "tiny", 3)
    path, ref = expert_file(folder, "transformer", "fp8-scaled", root / "wan-tiny-fp8_scaled")
    return folder, path, ref


@pytest.mark.slow
def test_two_ranks_run_the_file_from_one_shared_host_copy(cli, workdir, saved, torchrun):
    """`torchrun --nproc-per-node 2 -m chunkflow run --transformer FILE`: the transformer streamed from host memory
    (placed so in the plan), its e4m3 blocks in one segment for the host, the latents diffusers' pipeline's with
    the reference transformer (sequence parallel over two ranks: equal on these bf16 pipelines, as
    tests/test_generate_sp.py measures for a folder's transformer)."""
    from chunkflow_planner.catalog import get_model
    from file_pipelines import reference_latents

    folder, path, ref = saved
    assert cli("plan", "--model", "tiny", "--hardware", "cpu", "--host-mem-budget", "8GB",
               "--out", "plan.json").exit_code == 0
    data = json.loads(Path("plan.json").read_text())
    for c in data["pipeline"]["components"]:
        c["placement"] = "stream" if c["name"] == "transformer" else c["placement"]
    Path("placed.json").write_text(json.dumps(data))
    torchrun(2, ["-m", "chunkflow", "run", "--plan", "placed.json", "--weights", str(folder), "--transformer",
                 str(path), "--prompt", "a cat", "--negative-prompt", "blurry", "--seed", "5", "--latents",
                 "l.safetensors", "--device", "cpu", "--mode", "chunkflow", "--chunk-size", "16KB", "--residency",
                 "0.3", "--report", "r.json", "--warmup", "0"], timeout=240)
    g = json.loads(Path("r.json").read_text())["generation"]
    assert g["components"]["transformer"] == "stream" and g["load"]["transformer_formats"] == {
        "transformer": "fp8-scaled"}
    fp8_bytes = sum(v.numel() for k, v in load_file(path).items() if v.dtype == E4M3)
    assert g["host_shared_bytes"] >= fp8_bytes // 2 > 0  # the streamed tails, e4m3 as stored, once for the host
    assert len(g["host_peak_per_rank_bytes"]) == 2
    spec = get_model("tiny")
    want = reference_latents(spec, folder, {"transformer": ref}, "a cat", "blurry", 5, spec.default_workload)
    got = load_file("l.safetensors")["latents"]
    assert torch.equal(got, want)
