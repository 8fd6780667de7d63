"""diffusers' caches on an offloaded transformer (issue 54): each cache config gives, over several denoising steps
where it skips blocks, the output of the same config without chunkflow, bit for bit, in every mode and tier and
with `enable_cache` before or after `offload`; the handle counts the block runs computed and skipped as they were
(checked against a count made with module hooks, apart from chunkflow) and the bytes copied for the skipped ones.

A cache skips a block by replacing the forward its call runs: chunkflow binds a block's weights when its own forward
begins, so a skipped block waits for no copy and prefetches none; what was copied for it before the decision (its
prefetch, issued while the block before it ran) is `skipped_h2d_bytes`, counted exactly."""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch

from pipelines import block_lists, call_kwargs, one_thread, tiny_pipeline

pytest.importorskip("diffusers")
from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig, SeaCacheConfig, TaylorSeerCacheConfig  # noqa: E402
from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS  # noqa: E402

import chunkflow  # noqa: E402

STEPS = 8
CACHES = {  # thresholds at which each skips blocks on the tiny random pipelines within STEPS steps
    "first-block": lambda: FirstBlockCacheConfig(threshold=0.3),
    "mag": lambda: MagCacheConfig(threshold=0.5, num_inference_steps=STEPS, mag_ratios=FLUX_MAG_RATIOS),
    "taylorseer-lite": lambda: TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=2,
                                                     taylor_factors_dtype=torch.float32, use_lite_mode=True),
    "sea": lambda: SeaCacheConfig(threshold=0.5),  # Wan text-to-video only (diffusers' built-in adapter)
}
SETTINGS = {"chunkflow-r0": dict(mode="chunkflow", chunk_size="4KB", residency=0.0),
            "chunkflow-r0.3": dict(mode="chunkflow", chunk_size="4KB", residency=0.3),
            "layerwise": dict(mode="layerwise"),
            "fp8": dict(mode="chunkflow", chunk_size="4KB", residency=0.3, weight_dtype="fp8_e4m3"),
            "whole-first": dict(mode="chunkflow", chunk_size="4KB", residency=0.3, whole_blocks=(0,))}
CASES = [(k, c) for k in ("wan", "flux") for c in CACHES if not (c == "sea" and k == "flux")]


def _watch(pipe, sequence: list | None = None) -> tuple[Counter, list]:
    """Block calls whose forward ran (one of the block's own modules was called) and those skipped, counted with
    module hooks: apart from chunkflow's count, and the same without offload; `sequence` gets (block, ran) of each
    call in order. Only the blocks' children get pre-hooks (a pre-hook on a block itself would run between its call
    and its forward, where chunkflow then binds the block's weights at the call: runtime/skipping.py)."""
    counts, handles, ran = Counter(), [], {}

    def child_of(block):
        def child(module, args):
            ran[id(block)] = True
        return child

    def leave(block, args, out):
        did, ran[id(block)] = ran.get(id(block), False), False
        counts["computed" if did else "skipped"] += 1
        if sequence is not None:
            sequence.append((block, did))

    for blocks in block_lists(pipe).values():
        for block in blocks:
            handles.append(block.register_forward_hook(leave))
            handles += [m.register_forward_pre_hook(child_of(block)) for m in block.children()]
    return counts, handles


def _output(pipe, kind: str) -> torch.Tensor:
    with one_thread():
        out = pipe(**call_kwargs(kind, num_inference_steps=STEPS))
    return out.frames if hasattr(out, "frames") else out.images


def _reference(kind: str, cache: str, fp8: bool) -> tuple[torch.Tensor, Counter]:
    """The same cache without chunkflow (fp8: under diffusers' layerwise casting, what fp8 storage does)."""
    pipe = tiny_pipeline(kind)
    if fp8:
        pipe.transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    pipe.transformer.enable_cache(CACHES[cache]())
    counts, _ = _watch(pipe)
    return _output(pipe, kind), counts


@functools.cache
def reference(kind: str, cache: str, fp8: bool = False) -> tuple[torch.Tensor, Counter]:
    return _reference(kind, cache, fp8)


@pytest.mark.parametrize("order", ["cache-then-offload", "offload-then-cache"])
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("kind,cache", CASES, ids=[f"{k}-{c}" for k, c in CASES])
def test_a_cache_gives_its_output_without_offload_bit_for_bit_and_counts_its_skips(kind, cache, setting, order):
    want, ref_counts = reference(kind, cache, setting == "fp8")
    assert ref_counts["skipped"] > 0 and ref_counts["computed"] > 0  # the cache hit within the steps
    pipe = tiny_pipeline(kind)
    if order == "cache-then-offload":
        pipe.transformer.enable_cache(CACHES[cache]())
    handle = chunkflow.offload(pipe.transformer, device="cpu", **SETTINGS[setting])
    if order == "offload-then-cache":
        pipe.transformer.enable_cache(CACHES[cache]())
    sequence: list = []
    counts, _ = _watch(pipe, sequence)
    assert torch.equal(_output(pipe, kind), want)
    st = handle.stats()
    assert counts == ref_counts  # the blocks ran as without offload
    assert (st.blocks_computed, st.blocks_skipped) == (ref_counts["computed"], ref_counts["skipped"])
    assert st.reorders == 0  # the first forward entered every block in order (a cache skips the forward, not the call)
    streamed = {name: b.streamed_bytes for (name, _), b in zip(handle.blocks, handle.layouts)}
    skipped = handle.runs.skipped_by_block
    assert sum(skipped.values()) == st.blocks_skipped
    whole = sum(n * streamed[name] for name, n in skipped.items())  # every skipped block copied whole
    # at most what was prefetched for them (a prefetched block its cache skipped stays in its slot, valid: its next
    # call copies nothing), and a skip after a skip copies nothing
    assert st.skipped_h2d_bytes <= _prefetched_for_skipped(sequence, handle, streamed) <= whole
    skips_in_a_row = _skips_in_a_row(sequence, handle, streamed)
    assert (st.skipped_h2d_bytes < whole) == skips_in_a_row
    # against streaming with no cache: every block of every forward, and the next forward's first prefetched
    uncached = st.forwards * sum(streamed.values()) + streamed[_first_streamed(handle)]
    assert st.h2d_bytes_issued <= uncached and (st.h2d_bytes_issued < uncached) == skips_in_a_row
    forwards = handle.runs.since(0)
    assert len(forwards) == st.forwards and sum(f.computed + len(f.skipped) for f in forwards) == sum(counts.values())
    handle.remove()


def _prefetched_for_skipped(sequence: list, handle, streamed: dict[str, int]) -> int:
    """The bytes a skipped block's copies took: a streamed block is prefetched while the streamed block called before
    it runs (a forward's first, by the last of the forward before, or at offload); one its cache skips prefetches
    nothing and stays in its slot, so the block after it was copied only if it ran. Blocks kept whole are passed
    over: they copy nothing and prefetch nothing."""
    name_of = {id(m): name for name, m in handle.blocks}
    total, before_ran = 0, True
    for block, ran in sequence:
        name = name_of[id(block)]
        if not streamed[name]:
            continue
        if not ran and before_ran:
            total += streamed[name]
        before_ran = ran
    return total


def _skips_in_a_row(sequence: list, handle, streamed: dict[str, int]) -> bool:
    """Whether a streamed block was skipped right after the streamed block called before it was (across forwards)."""
    name_of = {id(m): name for name, m in handle.blocks}
    runs = [ran for block, ran in sequence if streamed[name_of[id(block)]]]
    return any(not a and not b for a, b in zip(runs, runs[1:]))


def _first_streamed(handle) -> str:
    """The name of the first block that streams (a forward's first block, unless it is kept whole)."""
    return next(name for (name, _), b in zip(handle.blocks, handle.layouts) if b.is_streamed)


def _bytes_by_forward(handle, pipe, kind: str) -> list[tuple[int, int]]:
    """(blocks computed, H2D bytes issued from its start to the next one's) of each transformer forward of one
    generation: what a step copies, its first-block prefetch for the next forward included."""
    starts: list[int] = []
    hook = pipe.transformer.register_forward_pre_hook(lambda m, a: starts.append(handle.streamer.bytes_h2d))
    done = handle.runs.forwards_done
    _output(pipe, kind)
    hook.remove()
    ends = starts[1:] + [handle.streamer.bytes_h2d]
    return [(f.computed, e - s) for f, s, e in zip(handle.runs.since(done), starts, ends)]


@pytest.mark.parametrize("kind", ["wan", "flux"])
def test_a_first_block_hit_copies_nothing_with_the_first_block_kept_whole(kind):
    """Under first-block caching a hit step runs block 0 only. Streamed, block 0 is copied again for the next step
    and block 1 prefetched as it runs; kept whole (whole_blocks=(0,)), block 1 stays in its slot from the step
    before and a hit step copies no byte: what StepTime.first_only prices (steptime.py)."""
    want, _ = reference(kind, "first-block")
    per_setting = {}
    for name, whole in (("streamed", ()), ("whole", (0,))):
        pipe = tiny_pipeline(kind)
        pipe.transformer.enable_cache(CACHES["first-block"]())
        handle = chunkflow.offload(pipe.transformer, device="cpu", mode="chunkflow", chunk_size="4KB",
                                   residency=0.3, whole_blocks=whole)
        per_setting[name] = _bytes_by_forward(handle, pipe, kind)
        if not whole:
            streamed_layouts = handle.layouts
        assert torch.equal(_output(pipe, kind), want)  # (a second generation: the same bits)
        handle.remove()
    hits = {name: [b for computed, b in forwards if computed == 1] for name, forwards in per_setting.items()}
    assert hits["streamed"] and len(hits["streamed"]) == len(hits["whole"])
    first_two = sum(b.streamed_bytes for b in streamed_layouts[:2])  # blocks 0 and 1, as StepTime.first_only has it
    assert hits["streamed"] == [first_two] * len(hits["streamed"]) and hits["whole"] == [0] * len(hits["whole"])
    computed = [b for c, b in per_setting["whole"] if c > 1]
    assert computed and all(b > 0 for b in computed)  # the computed steps still stream the other blocks


SKIP_WHOLE_STEPS = [("mag", ()), ("taylorseer-lite", ()), ("first-block", (0,))]


@pytest.mark.parametrize("cache,whole", SKIP_WHOLE_STEPS, ids=[c for c, _ in SKIP_WHOLE_STEPS])
@pytest.mark.parametrize("kind", ["wan", "flux"])
def test_skipped_steps_copy_no_byte_the_computed_ones_do_not_use(kind, cache, whole):
    """A cache whose skipped steps run no streamed block (MagCache and TaylorSeer lite, decided at the step's start;
    first-block caching with block 0 kept whole): over a generation the copies are exactly the computed forwards'
    streamed bytes and the first prefetch. The prefetch a skipped step finds made (`skipped_h2d_bytes`: issued
    before the decision) stays in its slot and is the next computed forward's, so no byte is copied for a skip."""
    pipe = tiny_pipeline(kind)
    pipe.transformer.enable_cache(CACHES[cache]())
    handle = chunkflow.offload(pipe.transformer, device="cpu", mode="chunkflow", chunk_size="4KB", residency=0.3,
                               whole_blocks=whole)
    _output(pipe, kind)
    st, forwards = handle.stats(), handle.runs.since(0)
    computed = sum(1 for f in forwards if len(f.skipped) == 0)
    assert 0 < computed < len(forwards) and st.skipped_h2d_bytes > 0  # it skipped, after a prefetch
    streamed = {name: b.streamed_bytes for (name, _), b in zip(handle.blocks, handle.layouts)}
    assert st.h2d_bytes_issued == computed * sum(streamed.values()) + streamed[_first_streamed(handle)]
    handle.remove()


def test_whole_blocks_past_the_module_are_refused_before_anything_changes():
    pipe = tiny_pipeline("flux")
    before = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    n = sum(len(b) for b in block_lists(pipe).values())
    with pytest.raises(chunkflow.OffloadError, match=f"names block {n}, but the module has {n} blocks"):
        chunkflow.offload(pipe.transformer, device="cpu", mode="chunkflow", chunk_size="4KB", whole_blocks=(0, n))
    assert "_chunkflow_handle" not in pipe.transformer.__dict__
    after = pipe.transformer.state_dict()
    assert all(torch.equal(before[k], after[k]) and after[k].device.type == "cpu" for k in before)


def test_remove_gives_the_cache_hooks_the_plain_forward_back_and_the_cache_goes_on_working():
    """A cache enabled before offload calls chunkflow's noting forward while offloaded (so its skips are counted) and
    the block's own forward again after remove(); the generation after remove() is the reference's."""
    want, _ = reference("wan", "first-block")
    pipe = tiny_pipeline("wan")
    pipe.transformer.enable_cache(CACHES["first-block"]())
    block = pipe.transformer.blocks[1]
    plain = type(block).forward
    handle = chunkflow.offload(pipe.transformer, device="cpu", mode="chunkflow", chunk_size="4KB", residency=0.3)
    held = block._diffusers_hook._fn_refs[0].original_forward
    assert held.__func__ is type(block).forward and held.__func__ is not plain
    assert torch.equal(_output(pipe, "wan"), want)
    handle.remove()
    assert block._diffusers_hook._fn_refs[0].original_forward.__func__ is plain
    assert torch.equal(_output(pipe, "wan"), want)
    pipe.transformer.disable_cache()
    assert block.forward.__func__ is plain  # diffusers' removal leaves the plain forward bound, as without offload


def test_a_forward_wrapped_out_of_sight_counts_every_run_as_computed():
    """A wrapper made before offload whose inner call chunkflow cannot see (a closure over the bound forward): no run
    is counted as skipped (none is), and the output is unchanged."""
    pipe = tiny_pipeline("flux")
    want = _output(pipe, "flux")
    for block in pipe.transformer.transformer_blocks:
        inner = block.forward
        block.forward = lambda *a, inner=inner, **k: inner(*a, **k)
    handle = chunkflow.offload(pipe.transformer, device="cpu", mode="chunkflow", chunk_size="4KB", residency=0.0)
    assert torch.equal(_output(pipe, "flux"), want)
    st = handle.stats()
    assert st.blocks_skipped == 0 and st.skipped_h2d_bytes == 0
    assert st.blocks_computed == STEPS * sum(len(b) for b in block_lists(pipe).values())
    handle.remove()


# ------------------------------------------------------------------------ the disk tier and the codec (catalog folders)

TIERS = {"disk": dict(mode="layerwise", disk_blocks=1),
         "disk+codec": dict(mode="chunkflow", chunk_bytes=4000, residency=0.0, disk_blocks=1, codec="exponent-pack"),
         "host+codec": dict(mode="chunkflow", chunk_bytes=4000, residency=0.3, codec="exponent-pack")}
FOLDER_CACHES = {"first-block": {"tiny": 0.3, "tiny-flux": 1.0}, "mag": {"tiny": 0.5, "tiny-flux": 0.5}}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from pipelines import save_catalog_pipeline

    root = tmp_path_factory.mktemp("caches")
    return {m: save_catalog_pipeline(m, root / m) for m in ("tiny", "tiny-flux")}  # bf16, as the codec streams


def _generation(model: str, folder, placement: str, setting: dict, cache: str):
    """The catalog pipeline built from `folder` (its transformer placed so), the cache enabled on its transformer,
    one generation of STEPS steps: (latents, the transformer's stats)."""
    from chunkflow.generate import generate
    from chunkflow.models.pipeline_build import build_pipeline
    from chunkflow_planner.catalog import get_model
    from chunkflow_planner.offload import OffloadConfig

    spec = get_model(model)
    threshold = FOLDER_CACHES[cache][model]
    config = (FirstBlockCacheConfig(threshold=threshold) if cache == "first-block" else
              MagCacheConfig(threshold=threshold, num_inference_steps=STEPS, mag_ratios=FLUX_MAG_RATIOS))
    with one_thread():
        built = build_pipeline(spec, {"transformer": placement}, OffloadConfig(**setting), torch.device("cpu"),
                               weights=folder)
        built.pipe.transformer.enable_cache(config)
        latents = generate(built, spec.default_workload, "a red fox in the snow", steps=STEPS, seed=0).latents
    stats = built.handles["transformer"].stats()
    built.remove()
    return latents, stats


@pytest.mark.parametrize("cache", list(FOLDER_CACHES))
@pytest.mark.parametrize("model", ["tiny", "tiny-flux"])
def test_a_cache_on_the_disk_tier_and_the_codec_gives_its_output_without_offload(folders, model, cache):
    want, _ = _generation(model, folders[model], "gpu", dict(mode="none"), cache)
    for name, setting in TIERS.items():
        got, st = _generation(model, folders[model], "stream", setting, cache)
        assert torch.equal(got, want), name
        assert st.blocks_skipped > 0 and st.skipped_h2d_bytes > 0, name
        assert st.disk_blocks == setting.get("disk_blocks", 0) and (st.codec_blocks > 0) == ("codec" in setting)


def test_a_block_with_anything_but_a_skipping_cache_before_its_forward_binds_at_its_call():
    """A forward pre-hook on a block may read or write its weights between its call and its forward: there the block
    binds at its call, under a cache too, so the hook finds the device copy in the compute dtype (fp8 storage: not
    the stored e4m3 bytes) and the blocks without such a hook still bind lazily (runtime/skipping.py)."""
    from chunkflow.runtime.skipping import binds_lazily

    pipe = tiny_pipeline("flux")
    pipe.transformer.enable_cache(CACHES["first-block"]())
    hooked = pipe.transformer.transformer_blocks[1]
    seen = []
    hooked.register_forward_pre_hook(lambda block, args: seen.append(block.norm1.linear.weight.dtype))
    handle = chunkflow.offload(pipe.transformer, device="cpu", mode="chunkflow", chunk_size="4KB", residency=0.3,
                               weight_dtype="fp8_e4m3")
    with torch.no_grad():
        assert not binds_lazily(hooked) and binds_lazily(pipe.transformer.transformer_blocks[0])
    _output(pipe, "flux")
    assert seen and set(seen) == {torch.float32}  # bound, cast to the compute dtype, before the hook ran
    handle.remove()
