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
            "fp8": dict(mode="chunkflow", chunk_size="4KB", residency=0.3, weight_dtype="fp8_e4m3")}
CASES = [(k, c) for k in ("wan", "flux") for c in CACHES if not (c == "sea" and k == "flux")]


def _watch(pipe, sequence: list | None = None) -> tuple[Counter, list]:
    """Block calls whose forward ran (one of the block's own modules was called) and those skipped, counted with
    module hooks: apart from chunkflow's count, and the same without offload; `sequence` gets (block, ran) of each
    call in order."""
    counts, calls, handles = Counter(), [], []

    def enter(block, args):
        calls.append(False)

    def child(module, args):
        if calls:
            calls[-1] = True

    def leave(block, args, out):
        ran = calls.pop()
        counts["computed" if ran else "skipped"] += 1
        if sequence is not None:
            sequence.append((block, ran))

    for blocks in block_lists(pipe).values():
        for block in blocks:
            handles += [block.register_forward_pre_hook(enter), block.register_forward_hook(leave)]
            handles += [m.register_forward_pre_hook(child) for m in block.children()]
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
    skips_in_a_row = any(not a and not b for (_, a), (_, b) in zip(sequence, sequence[1:]))
    assert (st.skipped_h2d_bytes < whole) == skips_in_a_row
    # against streaming with no cache: every block of every forward, and the next forward's first prefetched
    uncached = st.forwards * sum(streamed.values()) + streamed[handle.blocks[0][0]]
    assert st.h2d_bytes_issued <= uncached and (st.h2d_bytes_issued < uncached) == skips_in_a_row
    forwards = handle.runs.since(0)
    assert len(forwards) == st.forwards and sum(f.computed + len(f.skipped) for f in forwards) == sum(counts.values())
    handle.remove()


def _prefetched_for_skipped(sequence: list, handle, streamed: dict[str, int]) -> int:
    """The bytes a skipped block's copies took: a block is prefetched while the one called before it runs; one its
    cache skips prefetches nothing, so the block after it is copied only if it runs; a forward's first block is
    prefetched before it (at offload, by the last block, or at the end of the forward before where its last blocks
    were skipped)."""
    name_of = {id(m): name for name, m in handle.blocks}
    first = handle.blocks[0][0]
    total, before_ran = 0, True
    for block, ran in sequence:
        if name_of[id(block)] == first:
            before_ran = True
        if not ran and before_ran:
            total += streamed[name_of[id(block)]]
        before_ran = ran
    return total


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
