"""Still a normal model, round three: each operation on an offloaded model compared bit for bit with the same
operation on the same model without offload, in every tier (host store with and without residency, disk), and
what cannot be done refused before anything changes.

Classes covered: a parameter replaced (attribute, load_state_dict(assign=True), swap_tensors, the dict itself);
writes made inside a forward (the running block's own weights, in place or by `.data`, and a later block's);
a tensor taken from a weight inside a forward without a copy; a checkpoint rewritten in place with its times
restored (disk tier); a dtype change of a disk-tier model; saving (shards, torch.save, safetensors)."""

from __future__ import annotations

import io
import os
import warnings

import pytest
import torch
import torch.nn.utils.parametrize  # noqa: F401 (torch.nn.utils.parametrize below)
from torch import nn

pytest.importorskip("diffusers")
from test_disk_tier import _build, _forward, _saved  # noqa: E402

from chunkflow.runtime.disk import DiskTierError, DiskTierWarning  # noqa: E402

HOST = dict(mode="chunkflow", chunk_bytes=1000, residency=0.0)
RESIDENT = dict(mode="chunkflow", chunk_bytes=1000, residency=0.5)
LAYERWISE = dict(mode="layerwise")
DISK = dict(mode="chunkflow", chunk_bytes=1000, residency=0.0, disk_blocks=2)
TIERS = {"host": HOST, "resident": RESIDENT, "layerwise": LAYERWISE, "disk": DISK}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return _saved(tmp_path_factory.mktemp("tiny"))


def _same_as_without_offload(folder, cfg: dict, op, forwards: int = 3) -> None:
    """op(model) on the model offloaded with `cfg` and on the same model not offloaded: every forward, the state
    dict, and the module after remove() are equal."""
    ref, h_ref = _build(folder, mode="none")
    off, h_off = _build(folder, **cfg)
    outs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DiskTierWarning)  # (a disk block leaving the disk says so: tested below)
        for m in (ref, off):
            op(m)
            outs.append([_forward(m) for _ in range(forwards)])
    for i, (a, b) in enumerate(zip(*outs)):
        assert torch.equal(a, b), f"forward {i + 1} differs"
    sd_ref, sd_off = ref.state_dict(), off.state_dict()
    assert sd_ref.keys() == sd_off.keys() and all(torch.equal(sd_ref[k], sd_off[k]) for k in sd_ref)
    h_off.remove()
    h_ref.remove()
    after = off.state_dict()
    assert all(torch.equal(sd_ref[k], after[k]) for k in sd_ref)


def _replace_by_attribute(m):
    w = m.blocks[0].ffn.net[0].proj.weight
    m.blocks[0].ffn.net[0].proj.weight = nn.Parameter(torch.full_like(w.detach(), 0.01))


def _load_assign(m):
    m.load_state_dict({k: v.clone() * 0.5 for k, v in m.state_dict().items()}, assign=True)


def _swap_tensors(m):
    p = m.blocks[1].attn1.to_q.weight
    torch.utils.swap_tensors(p, nn.Parameter(torch.full_like(p.detach(), 0.02)))


def _replace_in_dict(m):
    lin = m.blocks[1].attn2.to_v
    lin._parameters["weight"] = nn.Parameter(torch.full_like(lin.weight.detach(), -0.01))


def _delete_and_register(m):
    lin = m.blocks[0].ffn.net[2]
    w = lin.weight
    del lin.weight
    lin.register_parameter("weight", nn.Parameter(w.detach() * 2))


class _Double(nn.Module):
    def forward(self, x):
        return x * 2


def _parametrize(m):
    torch.nn.utils.parametrize.register_parametrization(m.blocks[1].ffn.net[2], "weight", _Double())


@pytest.mark.parametrize("tier", list(TIERS))
@pytest.mark.parametrize("op", [_replace_by_attribute, _load_assign, _swap_tensors, _replace_in_dict,
                                _delete_and_register, _parametrize],
                         ids=lambda f: f.__name__.strip("_"))
def test_a_replaced_parameter_is_used_in_every_tier(folder, tier, op):
    """A disk block used to keep reading its file: the new parameter was ignored and remove() gave the file's back."""
    _same_as_without_offload(folder, TIERS[tier], op)


def test_a_disk_block_given_a_new_parameter_leaves_the_disk_and_says_so(folder):
    m, h = _build(folder, **DISK)
    _forward(m)
    _replace_by_attribute(m)
    with pytest.warns(DiskTierWarning, match="host memory"):
        _forward(m)
    assert h.stats().disk_blocks == 1  # the other block still reads its file
    h.remove()


def _hook_once(module: nn.Module, action) -> None:
    """A forward pre-hook on `module` that runs `action(module)` at its first call only."""
    calls = []

    def hook(mod, args):
        if not calls:
            with torch.no_grad():
                action(mod)
        calls.append(1)

    module.register_forward_pre_hook(hook)


def _own_weight_in_place(m):
    _hook_once(m.blocks[0].ffn.net[0].proj, lambda mod: mod.weight.mul_(1.5))


def _own_weight_by_data(m):
    _hook_once(m.blocks[1].attn1.to_q, lambda mod: setattr(mod.weight, "data", torch.full_like(mod.weight.data, .03)))


def _later_block_in_place(m):
    _hook_once(m.blocks[0].ffn.net[0].proj, lambda mod: m.blocks[1].ffn.net[0].proj.weight.mul_(1.5))


def _earlier_block_in_place(m):
    _hook_once(m.blocks[1].ffn.net[0].proj, lambda mod: m.blocks[0].ffn.net[2].weight.add_(0.01))


def _own_bias_straddling(m):  # a whole block's tensors written from its own first layer (resident and streamed parts)
    def scale(mod):
        for p in m.blocks[0].parameters():
            p.mul_(0.9)
    _hook_once(m.blocks[0].attn1.to_q, scale)


@pytest.mark.parametrize("tier", list(TIERS))
@pytest.mark.parametrize("op", [_own_weight_in_place, _own_weight_by_data, _later_block_in_place,
                                _earlier_block_in_place, _own_bias_straddling], ids=lambda f: f.__name__.strip("_"))
def test_a_write_inside_a_forward_is_applied_when_it_is_made(folder, tier, op):
    """A write made by a hook inside a forward: to the running block's weights (which then live on the device), to
    a block already prefetched, to one that ran: the rest of that forward, the next ones, the state dict and the
    module after remove() see it as without offload (it was lost or applied a forward late)."""
    _same_as_without_offload(folder, TIERS[tier], op)


@pytest.mark.parametrize("cfg,ref", [
    (HOST, dict(mode="none")), (LAYERWISE, dict(mode="none")), (DISK, dict(mode="none")),
    (dict(mode="chunkflow", chunk_bytes=100_000, residency=0.0, weight_dtype="fp8_e4m3"),
     dict(mode="chunkflow", chunk_bytes=100_000, residency=1.0, weight_dtype="fp8_e4m3")),
    (dict(mode="chunkflow", chunk_bytes=100_000, residency=0.0, weight_dtype="fp8_e4m3", fp8_cast="copy"),
     dict(mode="chunkflow", chunk_bytes=100_000, residency=1.0, weight_dtype="fp8_e4m3"))],
    ids=["host", "layerwise", "disk", "fp8", "fp8-copy"])
def test_a_weight_taken_inside_a_forward_keeps_its_values(tmp_path, cfg, ref):
    """`w = layer.weight.detach()` in a hook keeps that weight's values after the forward, as without offload (it
    pointed into a streaming slot that the next blocks overwrote)."""
    folder = _saved(tmp_path, "demo-wan", torch.bfloat16, shard="2MB")
    kept, outs = {}, {}
    for name, c in (("ref", ref), ("off", cfg)):
        m, h = _build(folder, "demo-wan", torch.bfloat16, **c)
        for i in (1, 2):  # blocks 1 and 2 of 4: their slots take blocks 3 and 0 later in the forward
            m.blocks[i].ffn.net[0].proj.register_forward_pre_hook(
                lambda mod, args, key=(name, i): None if kept.setdefault(key, mod.weight.detach()) is None else None)
        outs[name] = [_forward(m, "demo-wan", torch.bfloat16) for _ in range(2)]
        h.remove()
    for i in (1, 2):
        assert torch.equal(kept[("ref", i)].float(), kept[("off", i)].float()), i
    assert all(torch.equal(a, b) for a, b in zip(outs["ref"], outs["off"]))


def _rewrite_in_place(folder) -> None:
    """The largest shard's last bytes rewritten in place: same inode, same size, its times restored."""
    shard = max(folder.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    st = os.stat(shard)
    with open(shard, "r+b") as f:
        f.seek(st.st_size - 64)
        f.write(b"\x11" * 64)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    now = os.stat(shard)
    assert (now.st_size, now.st_mtime_ns, now.st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino)


@pytest.mark.parametrize("then", ["forward", "state_dict", "block_state_dict", "remove"])
def test_a_checkpoint_rewritten_in_place_with_its_times_restored_is_refused(tmp_path, then):
    """The disk tier sees a rewrite that keeps size, inode and modification time (the kernel says it was written):
    the next forward (after the read already in flight), state_dict() and remove() refuse; discard() still ends
    the handle."""
    folder = _saved(tmp_path)
    m, h = _build(folder, **DISK)
    _forward(m)
    _rewrite_in_place(folder)
    with pytest.raises(DiskTierError, match="changed after the model was offloaded"):
        if then == "forward":
            for _ in range(2):
                _forward(m)
        elif then == "state_dict":
            m.state_dict()
        elif then == "block_state_dict":
            m.blocks[1].state_dict()
        else:
            h.remove()
    h.discard()


@pytest.mark.parametrize("convert", [lambda m: m.to(torch.bfloat16), lambda m: m.half(),
                                     lambda m: m.to("cpu", torch.float16)], ids=["to-bf16", "half", "to-cpu-fp16"])
def test_a_dtype_change_of_a_disk_model_is_refused_before_anything_changes(folder, convert):
    """A dtype change would need every disk block in host memory: refused, every tensor as it was, the forward and
    remove() as before (it used to cast all 123 tensors, then raise, and remove() left them cast)."""
    ref, h_ref = _build(folder, mode="none")
    want = _forward(ref)
    m, h = _build(folder, **DISK)
    dtypes = {k: v.dtype for k, v in m.state_dict().items()}
    with pytest.raises(DiskTierError, match="nothing was changed"):
        convert(m)
    assert {k: v.dtype for k, v in m.state_dict().items()} == dtypes
    assert torch.equal(_forward(m), want)
    h.remove()
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in m.state_dict().items())
    h_ref.remove()


@pytest.mark.parametrize("tier", ["host", "resident", "disk"])
def test_saving_an_offloaded_model_writes_what_the_model_without_offload_writes(folder, tmp_path, tier):
    """save_pretrained(max_shard_size=...) shards as asked (every streamed block used to go into one shard: the
    tensors were views of one host store), torch.save of a block writes that block's bytes only (not the store),
    and safetensors saves the state dict."""
    from safetensors.torch import load_file, save_file

    ref, h_ref = _build(folder, mode="none")
    off, h_off = _build(folder, **TIERS[tier])
    _forward(off)
    layout = {}
    for name, m in (("ref", ref), ("off", off)):
        out = tmp_path / name
        m.save_pretrained(out, max_shard_size="20KB")
        layout[name] = sorted((p.name, p.stat().st_size) for p in out.glob("*.safetensors"))
    assert layout["off"] == layout["ref"] and len(layout["ref"]) > 4
    sizes = []
    for m in (ref, off):
        buf = io.BytesIO()
        torch.save(m.blocks[0].state_dict(), buf)
        sizes.append(len(buf.getvalue()))
    assert sizes[0] == sizes[1]
    save_file(off.state_dict(), str(tmp_path / "all.safetensors"))
    back = load_file(str(tmp_path / "all.safetensors"))
    assert all(torch.equal(back[k], v) for k, v in ref.state_dict().items())
    h_off.remove()
    h_ref.remove()
