"""The disk tier (runtime/disk.py): blocks whose streamed bytes stay in the checkpoint's files, read each forward,
on the CPU with the runtime's own code: bit-identical to no offload in every mix of tiers, host memory bounded by the
ring (measured in a process of its own), a changed file refused, writes moving a block to host memory."""

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
pytest.importorskip("safetensors")
from diffusers import WanTransformer3DModel  # noqa: E402

import chunkflow  # noqa: E402
from chunkflow.models.build import build_transformer  # noqa: E402
from chunkflow.models.inputs import make_inputs  # noqa: E402
from chunkflow.runtime.disk import DiskTierError, DiskTierWarning  # noqa: E402
from chunkflow.runtime.errors import OffloadError  # noqa: E402
from chunkflow_planner.catalog import get_model  # noqa: E402
from chunkflow_planner.checkpoint import CheckpointError  # noqa: E402
from chunkflow_planner.offload import OffloadConfig, OffloadConfigError, disk_block_indices  # noqa: E402


def _saved(tmp_path: Path, model: str = "tiny-wan", dtype=torch.float32, shard: str = "30KB") -> Path:
    torch.manual_seed(0)
    ref = WanTransformer3DModel(**get_model(model).diffusers.config).eval().to(dtype)
    folder = tmp_path / model
    ref.save_pretrained(folder, safe_serialization=True, max_shard_size=shard)
    return folder


def _build(folder: Path, model: str = "tiny-wan", dtype=torch.float32, **cfg):
    return build_transformer(model, weights=folder, dtype=dtype, device="cpu", config=OffloadConfig(**cfg))


def _forward(m, model: str = "tiny-wan", dtype=torch.float32):
    kw = make_inputs(get_model(model), None, dtype, "cpu", seed=1)
    with torch.no_grad():
        return m(**kw)[0]


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.glob("*.safetensors")):
        h.update(p.read_bytes())
    return h.hexdigest()


@pytest.mark.parametrize("model,dtype", [("tiny-wan", torch.float32), ("demo-wan", torch.bfloat16)])
@pytest.mark.parametrize("mode,chunk,r", [("chunkflow", 1000, 0.0), ("chunkflow", 3000, 0.5), ("layerwise", None, None)])
def test_every_mix_of_tiers_is_bit_identical_to_no_offload(tmp_path, model, dtype, mode, chunk, r):
    folder = _saved(tmp_path, model, dtype, shard="2MB" if model == "demo-wan" else "30KB")
    before = _digest(folder)
    ref, h0 = _build(folder, model, dtype, mode="none")
    want = _forward(ref, model, dtype)
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    h0.remove()
    n = len(ref.blocks)
    for k in (n, n // 2, 0):  # all on disk, half, none
        m, h = _build(folder, model, dtype, mode=mode, chunk_bytes=chunk, residency=r, disk_blocks=k)
        st = h.stats()
        assert st.disk_blocks == k
        for _ in range(3):  # the ring wraps: every read lands in a buffer the copies have left
            assert torch.equal(_forward(m, model, dtype), want), k
        assert h.stats().disk_bytes_read >= 2 * st.disk_bytes_per_step  # (the next read may be in flight)
        if k:  # the tails are not in host memory
            assert st.host_bytes < st.bytes_offloaded and st.disk_bytes_per_step > 0
        got = m.state_dict()  # outside the forward every tensor has its values (the file's, mapped)
        assert all(torch.equal(got[name], v) for name, v in state.items())
        h.remove()
        assert torch.equal(_forward(m, model, dtype), want)
    assert _digest(folder) == before  # nothing was written to the checkpoint


def test_disk_blocks_are_spread_over_the_forward():
    assert disk_block_indices(40, 4) == [5, 15, 25, 35]
    assert disk_block_indices(3, 3) == [0, 1, 2] and disk_block_indices(5, 0) == []
    with pytest.raises(OffloadConfigError, match="weight_dtype bf16"):
        OffloadConfig("chunkflow", disk_blocks=2, weight_dtype="fp8_e4m3")
    with pytest.raises(OffloadConfigError, match="mode none"):
        OffloadConfig("none", disk_blocks=1)
    with pytest.raises(OffloadConfigError, match="count"):
        OffloadConfig("chunkflow", disk_blocks=-1)


def test_a_module_without_files_is_refused_with_what_to_do():
    torch.manual_seed(0)
    m = WanTransformer3DModel(**get_model("tiny-wan").diffusers.config).eval()
    with pytest.raises(OffloadError, match="no file chunkflow reads"):
        chunkflow.offload(m, mode="chunkflow", disk_blocks=1, device="cpu")
    assert "_chunkflow_hook" not in m.blocks[0].__dict__  # nothing changed


def test_a_checkpoint_changed_after_offload_is_an_error_not_other_weights(tmp_path):
    folder = _saved(tmp_path)
    m, h = _build(folder, mode="chunkflow", chunk_bytes=1000, residency=0.0, disk_blocks=2)
    _forward(m)
    index = json.loads((folder / "diffusion_pytorch_model.safetensors.index.json").read_text())["weight_map"]
    shard = folder / index["blocks.1.ffn.net.2.weight"]  # a disk block's tensor lives there
    data = bytearray(shard.read_bytes())
    data[-100:] = bytes(100)  # same size, other bytes, a new modification time
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    with pytest.raises(DiskTierError, match="changed after the model was offloaded"):
        for _ in range(2):
            _forward(m)
    with pytest.raises(DiskTierError, match="changed after"):  # remove() would give back the new bytes: refused
        h.remove()
    h.discard()


def test_a_truncated_file_is_a_clear_error_before_the_first_forward(tmp_path):
    folder = _saved(tmp_path)
    shard = max(folder.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 64)
    with pytest.raises((CheckpointError, DiskTierError), match="truncated"):
        _build(folder, mode="chunkflow", chunk_bytes=1000, disk_blocks=2)


def test_load_state_dict_moves_the_written_blocks_to_host_memory(tmp_path):
    folder = _saved(tmp_path)
    before = _digest(folder)
    m, h = _build(folder, mode="chunkflow", chunk_bytes=1000, residency=0.0, disk_blocks=2)
    torch.manual_seed(3)
    other = WanTransformer3DModel(**get_model("tiny-wan").diffusers.config).eval()
    with pytest.warns(DiskTierWarning, match="host memory"):
        m.load_state_dict(other.state_dict())
        got = _forward(m)
    assert torch.equal(got, _forward(other))  # the new weights, not the file's
    assert h.stats().disk_blocks == 0 and h.stats().host_bytes >= h.stats().bytes_offloaded
    assert _digest(folder) == before  # the file was never written
    h.remove()


def test_lora_on_disk_blocks_matches_the_same_lora_without_offload(tmp_path):
    pytest.importorskip("peft")
    from test_fidelity import _lora_lifecycle

    folder = _saved(tmp_path)
    ref, h0 = _build(folder, mode="none")
    m, h = _build(folder, mode="chunkflow", chunk_bytes=1000, residency=0.0, disk_blocks=2)
    kw = make_inputs(get_model("tiny-wan"), None, torch.float32, "cpu", seed=1)
    want, got = [], []
    _lora_lifecycle(ref, kw, want)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DiskTierWarning)  # the adapter's layers are in no file: host memory
        _lora_lifecycle(m, kw, got)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and len(got) == 8
    assert h.stats().disk_blocks == 0
    h.remove()
    h0.remove()


_RSS_CHILD = textwrap.dedent("""
    import json, os, pathlib, sys, torch
    from chunkflow.loading.reader import FileReader
    from chunkflow.models.adapters import find_blocks
    from chunkflow.models.build import transformer_module, transformer_source
    from chunkflow.models.inputs import make_inputs
    from chunkflow.runtime.handle import offload
    from chunkflow_planner.catalog import get_model
    from chunkflow_planner.offload import OffloadConfig

    def status(key):  # VmHWM: this process's peak since exec (ru_maxrss keeps the forking parent's)
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    folder, k = sys.argv[1], int(sys.argv[2])
    spec = get_model("demo-wan")  # demo-wan's architecture, larger (the folder's config)
    config = json.loads(os.environ["CHUNKFLOW_TEST_DEMO_CONFIG"])
    spec = spec.model_copy(update={"diffusers": spec.diffusers.model_copy(update={"config": config})})
    module = transformer_module(spec, torch.bfloat16)
    kw = make_inputs(spec, None, torch.bfloat16, "cpu", seed=1)
    base = status("VmRSS")
    reader = FileReader()
    source = transformer_source(pathlib.Path(folder), spec, module, reader, None)
    h = offload(module, OffloadConfig("chunkflow", "64KB", 0.0, disk_blocks=k), device="cpu",
                blocks=find_blocks(module), source=source)
    reader.close()
    with torch.no_grad():
        for _ in range(2):
            module(**kw)
    peak = status("VmHWM")
    print(json.dumps({"base": base, "peak": peak, "offloaded": h.stats().bytes_offloaded}))
""")


@pytest.mark.slow
def test_peak_resident_memory_stays_inside_the_ring_while_the_weights_are_on_disk(tmp_path):
    """Measured, in a process of its own: a model whose block weights are several times the host memory the disk
    tier may use (its ring, the CPU's slots, activations) runs with every block on disk; the same run with none on
    disk holds the weights (the measurement sees them)."""
    config = dict(get_model("demo-wan").diffusers.config)
    config.update(num_layers=24, num_attention_heads=8, attention_head_dim=64, ffn_dim=8192)
    torch.manual_seed(0)
    WanTransformer3DModel(**config).to(torch.bfloat16).save_pretrained(tmp_path / "w", max_shard_size="50MB")

    def run(k: int) -> dict:
        env = {**os.environ, "CHUNKFLOW_TEST_DEMO_CONFIG": json.dumps(config)}
        out = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(tmp_path / "w"), str(k)], env=env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    disk, host = run(24), run(0)
    weights = disk["offloaded"]
    assert weights > 450e6
    # on the CPU the "device" is host memory too: the ring, both slots, the loader's staging and the activations
    assert disk["peak"] - disk["base"] < 0.5 * weights, disk
    assert host["peak"] - host["base"] > 0.9 * weights, host


# ------------------------------------------------------------------------------------------------ planner and CLI


def _plan_h200(host_gb: float, rate: float | None, **kw):
    from chunkflow_planner.catalog import get_hardware
    from chunkflow_planner.planner import ResolvedHardware, make_plan
    from chunkflow_planner.workload import make_workload

    spec = get_model("wan2.1-14b")
    hw = get_hardware("h200").model_copy(update={"disk_read_gbps": rate})
    w = make_workload(spec, frames=81, height=720, width=1280, steps=kw.pop("steps", 50))
    return make_plan(spec, w, ResolvedHardware(hw, "test"), budget=24 * 10**9, host_budget=int(host_gb * 1e9),
                     **kw)[0]


def test_the_planner_keeps_the_fewest_blocks_on_disk_that_fit_the_host_budget():
    from chunkflow_planner.catalog import get_hardware
    from chunkflow_planner.memory import estimate_memory
    from chunkflow_planner.policy import Infeasible

    with pytest.raises(Infeasible, match="calibrate --weights"):  # no disk rate: it says how to get one
        _plan_h200(32, None)
    plan = _plan_h200(32, 1.5)
    k = plan.offload.disk_blocks
    spec = get_model("wan2.1-14b")
    usable = 32e9 / (1 + plan.host_memory_margin)  # the host model's margin is kept free (catalog.host_mem_margin)
    assert plan.host_memory_margin == get_hardware("h200").host_mem_margin > 0
    assert 0 < k < spec.n_blocks and plan.prediction.host_memory_bytes <= usable
    assert plan.prediction.disk_read_gbps == 1.5 and "on disk" in plan.reason
    fewer = plan.offload.with_overrides(disk_blocks=k - 1)  # one block fewer would not fit
    w = plan.workload.to_workload()
    held = estimate_memory(spec, w, plan.offload).pinned_host - estimate_memory(spec, w, fewer).pinned_host
    assert held < 0 and plan.prediction.host_memory_bytes - held > usable
    per_forward = estimate_memory(spec, w, plan.offload).disk_read
    assert plan.prediction.disk_read_bytes_per_step == per_forward * w.cfg_passes
    assert _plan_h200(64, 1.5).offload.disk_blocks < k  # more host memory, fewer blocks on disk


def test_a_slow_disk_is_priced_and_the_shortfall_names_the_rate_that_would_do():
    from chunkflow_planner.policy import Infeasible

    fast = _plan_h200(32, 1.5, steps=4)
    assert fast.prediction.disk_stall_s == 0
    slow = _plan_h200(32, 0.05, steps=4)  # 50 MB/s: the reads cannot hide
    assert slow.prediction.disk_stall_s > 0 and slow.prediction.step_time_s > fast.prediction.step_time_s
    with pytest.raises(Infeasible, match=r"a disk of [0-9.]+ GB/s would hide it"):
        _plan_h200(32, 0.05, steps=4, target_time=fast.prediction.generation_time_s * 1.01)


def test_run_with_a_disk_plan_reads_the_files_and_matches_the_host_plan(cli, workdir, monkeypatch):
    pytest.importorskip("transformers")
    from pipelines import as_hub_cache, one_thread, save_catalog_pipeline
    from safetensors.torch import load_file

    folder = save_catalog_pipeline("tiny", workdir / "tiny")
    result = cli("plan", "--model", "tiny", "--hardware", "cpu", "--host-mem-budget", "8GB", "--out", "host.json")
    assert result.exit_code == 0, result.output
    plan = json.loads(Path("host.json").read_text())
    for c in plan["pipeline"]["components"]:
        c["placement"] = "stream" if c["kind"] == "transformer" else c["placement"]
    plan["offload"].update(mode="chunkflow", chunk_bytes=16000, residency=0.3)
    Path("host.json").write_text(json.dumps(plan))
    plan["offload"]["disk_blocks"] = 2
    plan["hardware"]["spec"]["disk_read_gbps"] = 1.0  # what `calibrate --weights` measures: the run predicts with it
    Path("disk.json").write_text(json.dumps(plan))
    said = cli("run", "--plan", "disk.json", "--prompt", "a cat")
    assert said.exit_code == 2 and "--weights" in said.output  # the files it reads must be given
    outs = {}
    for name in ("host", "disk"):
        with one_thread():
            result = cli("run", "--plan", f"{name}.json", "--weights", folder, "--prompt", "a cat", "--seed", "5",
                         "--latents", f"{name}.safetensors", "--report", f"{name}-report.json")
        assert result.exit_code == 0, result.output
        outs[name] = load_file(f"{name}.safetensors")["latents"]
    assert torch.equal(outs["disk"], outs["host"])
    stats = json.loads(Path("disk-report.json").read_text())["stats"]
    assert stats["disk_blocks"] == 2 and stats["disk_bytes_read"] >= stats["disk_bytes_per_step"] > 0
    assert "blocks read from the checkpoint's files" in " ".join(result.output.split())
    # from a Hugging Face cache: the snapshot's files are symlinks to blobs, read and checked through them
    as_hub_cache(folder, workdir / "hub", "someone/tiny-wan")
    monkeypatch.setenv("HF_HUB_CACHE", str(workdir / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with one_thread():
        result = cli("run", "--plan", "disk.json", "--weights", "someone/tiny-wan", "--prompt", "a cat", "--seed", "5",
                     "--latents", "cache.safetensors", "--report", "cache-report.json")
    assert result.exit_code == 0, result.output
    assert torch.equal(load_file("cache.safetensors")["latents"], outs["host"])
    assert json.loads(Path("cache-report.json").read_text())["stats"]["disk_bytes_read"] > 0
