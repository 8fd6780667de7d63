"""Blocks found, not listed (issue 37): `offload(model)` without `blocks=` on diffusers DiT classes outside the
catalog, exact and removed cleanly; the blocks' execution order checked on the first forward (a wrong declared
order re-laid out, never copied twice again); the catalog's lists checked against the ones found."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("diffusers")

import chunkflow  # noqa: E402
from chunkflow import OffloadError  # noqa: E402
from chunkflow.models.adapters import find_blocks  # noqa: E402
from chunkflow.models.discover import block_lists  # noqa: E402
from chunkflow.probes import ChunkLog  # noqa: E402
from pipelines import one_thread  # noqa: E402
from tiny import MODULES as CATALOGUED  # noqa: E402
from tiny_uncatalogued import MODELS, build  # noqa: E402

# the block lists each class holds, in the order its forward runs them (read from diffusers' forward code)
RUN_ORDER = {"sd3": ["transformer_blocks"], "cogvideox": ["transformer_blocks"], "ltx_video": ["transformer_blocks"],
             "sana": ["transformer_blocks"], "lumina2": ["context_refiner", "noise_refiner", "layers"],
             "mochi": ["transformer_blocks"], "allegro": ["transformer_blocks"], "skyreels_v2": ["blocks"],
             "wan_vace": ["vace_blocks", "blocks"], "cogview4": ["transformer_blocks"],
             "chroma": ["transformer_blocks", "single_transformer_blocks"]}


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def _run(m, kw):
    with torch.no_grad():
        return m(**kw)[0]


def _state(m):
    return {k: v.clone() for k, v in m.state_dict().items()}


def _same_state(m, before) -> bool:
    now = m.state_dict()
    return now.keys() == before.keys() and all(torch.equal(now[k], before[k]) and now[k].dtype == before[k].dtype
                                               for k in before)


def _entered(m, kw) -> list[str]:
    """The blocks' names in the order a plain forward enters them (forward pre-hooks, no offload)."""
    names = {id(b): f"{n}.{i}" for n, lst in block_lists(m).items() for i, b in enumerate(lst)}
    seen: list[str] = []
    hooks = [b.register_forward_pre_hook(lambda mod, a: seen.append(names[id(mod)])) for lst in block_lists(m).values()
             for b in lst]
    _run(m, kw)
    for h in hooks:
        h.remove()
    return seen


def _per_forward(h, m, kw, ref) -> int:
    """Host-to-device bytes the streamer enqueued during one forward (its output checked exact): every streamed byte
    once where the layout is the order the blocks run in (the last block prefetches the next forward's first)."""
    with h.observing(ChunkLog()) as (log,):
        assert torch.equal(_run(m, kw), ref)
    return sum(c.end - c.start for c in log if c.kind == "h2d")


def test_at_least_eight_uncatalogued_classes():
    from chunkflow_planner.catalog import load_models

    catalog = {s.diffusers.cls for s in load_models().values()}
    classes = {type(build(n)[0]).__name__ for n in MODELS}
    assert len(classes) >= 8 and not classes & catalog


@pytest.mark.parametrize("name", list(MODELS))
def test_lists_found(name):
    m, _ = build(name)
    assert sorted(block_lists(m)) == sorted(RUN_ORDER[name])
    found = find_blocks(m)
    assert len(found) == sum(len(getattr(m, n)) for n in RUN_ORDER[name])
    big = sum(p.numel() for b in found for p in b.parameters())
    assert big > 0.3 * sum(p.numel() for p in m.parameters())  # tiny configs: embeddings weigh more than at scale


@pytest.mark.parametrize("name", list(MODELS))
def test_offload_without_blocks_exact_and_removed(name):
    m, kw = build(name)
    ref = _run(m, kw)
    state = _state(m)
    h = chunkflow.offload(m, mode="chunkflow", chunk_size=4096, residency=0.25, device="cpu")
    assert h.stats().n_blocks == sum(len(getattr(m, n)) for n in RUN_ORDER[name])
    assert torch.equal(_run(m, kw), ref)  # the first forward: the order it enters the blocks is checked
    # the layout is the order the blocks ran in: each later forward copies every streamed byte once
    assert [b.name for b in h.layouts] == _entered(build(name)[0], kw)  # a plain copy: same class, same weights
    for _ in range(2):
        assert _per_forward(h, m, kw, ref) == h.stats().streamed_bytes_per_step
    h.remove()
    assert _same_state(m, state)
    assert not any("_chunkflow_base" in type(x).__dict__ for x in m.modules())
    assert torch.equal(_run(m, kw), ref)


@pytest.mark.parametrize("name", ["wan_vace", "lumina2"])
def test_print_order_is_not_run_order(name):
    """Wan-VACE's vace_blocks and Lumina2's refiners run in another order than they are registered: the first
    forward lays them out as they ran, once, and later forwards copy no block twice."""
    m, kw = build(name)
    ref = _run(m, kw)
    ran = _entered(m, kw)
    assert ran != [f"{n}.{i}" for n, lst in block_lists(m).items() for i in range(len(lst))]
    h = chunkflow.offload(m, mode="chunkflow", chunk_size=2048, device="cpu")
    assert torch.equal(_run(m, kw), ref)
    st = h.stats()
    assert (st.reorders, st.relayouts) == (1, 1)
    assert [b.name for b in h.layouts] == ran
    for _ in range(2):
        assert _per_forward(h, m, kw, ref) == h.stats().streamed_bytes_per_step
    assert h.stats().reorders == 1  # checked once
    h.remove()


@pytest.mark.parametrize("name,wrong", [
    ("sd3", lambda m: list(reversed(m.transformer_blocks))),
    ("chroma", lambda m: [m.single_transformer_blocks, m.transformer_blocks]),
    ("cogvideox", lambda m: [m.transformer_blocks[1], m.transformer_blocks[0], m.transformer_blocks[2]]),
])
def test_wrong_declared_order_relaid_out(name, wrong):
    m, kw = build(name)
    ref = _run(m, kw)
    state = _state(m)
    h = chunkflow.offload(m, mode="chunkflow", chunk_size=2048, device="cpu", blocks=wrong(m))
    streamed = h.stats().streamed_bytes_per_step
    first = _per_forward(h, m, kw, ref)
    assert first > streamed  # the declared order made the first forward copy blocks it then evicted unused...
    assert h.stats().reorders == 1
    assert [b.name for b in h.layouts] == _entered(build(name)[0], kw)
    for _ in range(2):  # ... and never again
        assert _per_forward(h, m, kw, ref) == streamed
    h.remove()
    assert _same_state(m, state)


def test_layerwise_mode_reorders_too():
    m, kw = build("sana")
    ref = _run(m, kw)
    h = chunkflow.offload(m, mode="layerwise", device="cpu", blocks=list(reversed(m.transformer_blocks)))
    assert torch.equal(_run(m, kw), ref)
    assert h.stats().reorders == 1
    assert _per_forward(h, m, kw, ref) == h.stats().streamed_bytes_per_step
    h.remove()


def test_skipped_block_keeps_the_layout_and_breaks_nothing():
    """SD3's skip_layers leaves a block out of the forward: the order of the rest is the layout's, nothing is laid
    out again, and a later forward that runs every block is exact."""
    m, kw = build("sd3")
    ref_skip = _run(m, {**kw, "skip_layers": [1]})
    ref = _run(m, kw)
    h = chunkflow.offload(m, mode="chunkflow", chunk_size=2048, device="cpu")
    assert torch.equal(_run(m, {**kw, "skip_layers": [1]}), ref_skip)
    assert h.stats().reorders == 0
    for _ in range(2):
        assert _per_forward(h, m, kw, ref) == h.stats().streamed_bytes_per_step
    h.remove()


def test_order_checked_after_a_failed_first_forward():
    """A first forward that raises is not the one checked: the next complete one is."""
    m, kw = build("wan_vace")
    ref = _run(m, kw)
    h = chunkflow.offload(m, mode="chunkflow", chunk_size=2048, device="cpu")
    bad = {**kw, "control_hidden_states": kw["control_hidden_states"][:, :3]}  # wrong channel count
    with pytest.raises(RuntimeError):
        _run(m, bad)
    assert h.stats().reorders == 0
    assert torch.equal(_run(m, kw), ref)
    assert h.stats().reorders == 1
    assert _per_forward(h, m, kw, ref) == h.stats().streamed_bytes_per_step
    h.remove()


def test_block_run_twice_is_said():
    """A model that runs a block twice in one forward is exact, and told that its weights are copied each time."""

    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

        def forward(self, x):
            for b in [self.blocks[0], self.blocks[1], self.blocks[0], self.blocks[2]]:
                x = b(x)
            return (x,)

    torch.manual_seed(0)
    m = Twice().eval()
    x = torch.randn(2, 8)
    ref = _run(m, {"x": x})
    h = chunkflow.offload(m, mode="layerwise", device="cpu")
    with pytest.warns(UserWarning, match="more than once"):
        assert torch.equal(_run(m, {"x": x}), ref)
    assert h.stats().reorders == 0
    h.remove()


def test_no_block_list_asks_for_blocks():
    m = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(OffloadError, match="blocks="):
        chunkflow.offload(m, device="cpu")


@pytest.mark.parametrize("name", list(CATALOGUED))
def test_catalog_lists_match_the_lists_found(name):
    m, blocks, _ = CATALOGUED[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        found = find_blocks(m)
    assert [id(b) for b in found] == [id(b) for lst in blocks for b in lst]


def test_catalog_that_differs_is_warned():
    from chunkflow_planner.catalog import get_model

    m, blocks, _ = CATALOGUED["flux"]()
    spec = get_model("FLUX.1-dev")
    half = spec.model_copy(update={"blocks": spec.blocks[:1]})  # a catalog that forgot the single blocks
    with pytest.warns(UserWarning, match="single_transformer_blocks"):
        found = find_blocks(m, [half])
    assert [id(b) for b in found] == [id(b) for b in m.transformer_blocks]


def test_write_before_the_first_forward_seen_by_a_block_run_before_block_0():
    """Wan-VACE's first block to run is vace_blocks.0, laid out after `blocks` (attribute order): a write made before
    the first forward to its resident head reaches the device before it runs, and the re-layout after that forward
    keeps it."""
    m, kw = build("wan_vace")
    plain, _ = build("wan_vace")
    h = chunkflow.offload(m, mode="chunkflow", chunk_size=2048, residency=0.5, device="cpu")  # heads on the device
    for model in (m, plain):
        with torch.no_grad():
            for p in model.vace_blocks[0].parameters():
                p.mul_(1.5)
    ref = _run(plain, kw)
    assert torch.equal(_run(m, kw), ref)
    assert torch.equal(_run(m, kw), ref)
    h.remove()


def test_forward_without_blocks_is_not_the_one_checked():
    """A forward that enters no block (a model whose forward can return early) leaves the check to the next."""

    class Early(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

        def forward(self, x, skip=False):
            if not skip:
                for b in reversed(self.blocks):
                    x = b(x)
            return (x,)

    torch.manual_seed(0)
    m = Early().eval()
    x = torch.randn(2, 8)
    ref = _run(m, {"x": x})
    h = chunkflow.offload(m, mode="layerwise", device="cpu")
    _run(m, {"x": x, "skip": True})
    assert torch.equal(_run(m, {"x": x}), ref)
    assert h.stats().reorders == 1
    assert [b.name for b in h.layouts] == ["blocks.2", "blocks.1", "blocks.0"]
    h.remove()


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_backward_through_the_first_forward_after_it_was_relaid_out(checkpointing):
    """The first forward is laid out again as soon as it ends, before its backward: the blocks recomputed for that
    backward are bound to their own weights in the new layout (gradients as without offload)."""

    def step(offloaded: bool):
        m, kw = build("wan_vace")
        m.train().requires_grad_(True)
        if checkpointing:
            m.enable_gradient_checkpointing()
        h = chunkflow.offload(m, mode="chunkflow", chunk_size=2048, device="cpu") if offloaded else None
        on_host = []  # blocks that ran with weights still in the host store (on CUDA: a device error, or worse)

        def bound(block, args):
            if h is not None and not h.removed:
                host = h.store.data.untyped_storage().data_ptr()
                on_host.extend(p.untyped_storage().data_ptr() == host for p in block.parameters())

        hooks = [b.register_forward_pre_hook(bound) for lst in block_lists(m).values() for b in lst]
        m(**kw)[0].square().mean().backward()
        for hk in hooks:
            hk.remove()
        assert h is None or (on_host and not any(on_host))
        grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        if h is not None:
            assert h.stats().reorders == 1
            h.remove()
        return grads

    ref, got = step(False), step(True)
    assert ref.keys() == got.keys() and all(torch.equal(ref[n], got[n]) for n in ref)


def test_reorder_with_blocks_read_from_disk(tmp_path):
    """The re-layout keeps the disk tier (tiny-wan's two blocks both on disk): blocks still read from the
    checkpoint's files, exact, one copy of each streamed byte per forward after the first, the module given back as
    it was."""
    pytest.importorskip("safetensors")
    from diffusers import WanTransformer3DModel

    from chunkflow.loading.reader import FileReader
    from chunkflow.models.build import transformer_module, transformer_source
    from chunkflow.models.inputs import make_inputs
    from chunkflow_planner.catalog import get_model
    from chunkflow_planner.offload import OffloadConfig

    spec = get_model("tiny-wan")
    torch.manual_seed(0)
    plain = WanTransformer3DModel(**spec.diffusers.config).eval()
    plain.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="30KB")
    kw = make_inputs(spec, None, torch.float32, "cpu", seed=1)
    ref = _run(plain, kw)

    def offloaded(order):
        m = transformer_module(spec, torch.float32)
        reader = FileReader()
        h = chunkflow.offload(m, OffloadConfig("chunkflow", "4KB", 0.0, disk_blocks=2), device="cpu",
                              blocks=order(m), source=transformer_source(tmp_path, spec, m, reader, None))
        reader.close()
        assert torch.equal(_run(m, kw), ref)
        reads = []
        for _ in range(2):
            before = h.stats().disk_bytes_read
            assert _per_forward(h, m, kw, ref) == h.stats().streamed_bytes_per_step
            reads.append(h.stats().disk_bytes_read - before)
        return m, h, reads

    m, h, reads = offloaded(lambda m: list(reversed(m.blocks)))
    st = h.stats()
    assert (st.reorders, st.disk_blocks) == (1, 2) and [b.name for b in h.layouts] == ["blocks.0", "blocks.1"]
    assert all(r > 0 for r in reads)  # the files still read each forward (how much when: the reader's read-ahead)
    h.remove()
    assert _same_state(m, plain.state_dict())


def test_reorder_with_fp8_storage():
    """fp8-stored blocks laid out again in the order they ran give what the same storage gives in the right order."""

    def outputs(order):
        m, kw = build("sd3")
        h = chunkflow.offload(m, mode="chunkflow", chunk_size=2048, device="cpu", weight_dtype="fp8_e4m3",
                              blocks=order(m))
        outs = [_run(m, kw) for _ in range(2)]
        st = h.stats()
        h.remove()
        return outs, st

    right, _ = outputs(lambda m: [m.transformer_blocks])
    wrong, st = outputs(lambda m: list(reversed(m.transformer_blocks)))
    assert st.reorders == 1 and st.fp8_tensors > 0
    assert all(torch.equal(a, b) for a, b in zip(right, wrong))


def _text_towers():
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    clip = CLIPTextConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                          num_attention_heads=2, projection_dim=8, max_position_embeddings=16)
    t5 = T5Config(vocab_size=100, d_model=16, d_ff=32, d_kv=8, num_heads=2, num_layers=3)
    return {"clip-with-projection": (CLIPTextModelWithProjection, clip, "text_model.encoder.layers"),
            "clip": (CLIPTextModel, clip, "encoder.layers"), "t5": (T5EncoderModel, t5, "encoder.block")}


@pytest.mark.parametrize("name", ["clip-with-projection", "clip", "t5"])
def test_text_towers_blocks_found_at_their_depth_and_offloaded_exactly(name):
    """SD3 streams CLIP towers, whose layers sit three levels down (text_model.encoder.layers): found there when no
    list is shallower, and offloaded bit for bit (a 6 GB SD3 plan failed at load with 'found no block list')."""
    cls, cfg, path = _text_towers()[name]
    torch.manual_seed(0)
    m = cls(cfg).eval()
    (found,) = block_lists(m)
    assert found.endswith(path) and len(m.get_submodule(found)) == 3  # at its depth (CLIPTextModel's varies)
    ids = torch.randint(0, 100, (1, 7))
    with torch.no_grad():
        ref = m(input_ids=ids).last_hidden_state
        h = chunkflow.offload(m, mode="chunkflow", chunk_size=4096, residency=0.0, device="cpu")
        assert h.stats().n_blocks == 3
        assert torch.equal(m(input_ids=ids).last_hidden_state, ref)
        h.remove()
        assert torch.equal(m(input_ids=ids).last_hidden_state, ref)
