"""A step cache on a pipeline's transformers (`run --cache`): the validated setting (chunkflow_planner/cache.py) as
diffusers' cache config, enabled with the transformer's own `enable_cache` (before or after chunkflow offloads it:
either gives the cache's output bit for bit, tests/test_caches.py), and the block runs it skipped, watched.

A cache that would do nothing is refused before the run: one diffusers refuses, or one that hooks no module of the
transformer (TaylorSeer's attention patterns miss Wan's `attn1`/`attn2`). One that hooks modules but never skips
(a threshold that never fires, SeaCache without the step information its adapter needs) shows in the counts.

`BlockWatch` counts each transformer forward's block calls whose own forward ran (one of the block's modules was
called) and those skipped, with module hooks: the same wherever the transformer is placed (streamed or whole on the
device), and apart from chunkflow's own count of a streamed transformer (`OffloadStats.blocks_skipped`, which also
has the bytes copied for the skipped blocks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from chunkflow_planner.cache import CacheSetting, CacheSpecError, cache_label


def diffusers_config(setting: CacheSetting, steps: int):
    """diffusers' config object for `setting`, for a generation of `steps` denoising steps (MagCache's count)."""
    from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig, SeaCacheConfig, TaylorSeerCacheConfig

    s = setting
    if s.kind == "first-block":
        return FirstBlockCacheConfig(threshold=s.threshold)
    if s.kind == "mag":
        import torch
        from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS

        ratios = None if s.ratios is None else FLUX_MAG_RATIOS if s.ratios == "flux" else torch.tensor(s.ratios)
        return MagCacheConfig(threshold=s.threshold, max_skip_steps=s.max_skip_steps,
                              retention_ratio=s.retention_ratio, num_inference_steps=steps, mag_ratios=ratios,
                              calibrate=s.calibrate)
    if s.kind == "taylorseer":
        return TaylorSeerCacheConfig(cache_interval=s.cache_interval,
                                     disable_cache_before_step=s.disable_cache_before_step,
                                     disable_cache_after_step=s.disable_cache_after_step, max_order=s.max_order,
                                     use_lite_mode=s.lite)
    return SeaCacheConfig(threshold=s.threshold, residual_order=s.residual_order, retention_steps=s.retention_steps,
                          cache_end_steps=s.cache_end_steps, max_consecutive_cached=s.max_consecutive_cached)


def _hooked(module: nn.Module) -> int:
    """Hooks diffusers' registries hold on `module` and the modules inside it."""
    return sum(len(getattr(m, "_diffusers_hook").hooks) for m in module.modules()
               if getattr(m, "_diffusers_hook", None) is not None)


def enable_cache(module: nn.Module, setting: CacheSetting, steps: int, name: str = "transformer") -> None:
    """`setting` enabled on `module` (a diffusers transformer, offloaded or not). CacheSpecError where diffusers
    refuses it, and where it would hook nothing (disabled again first)."""
    label = cache_label(setting)
    if not callable(getattr(module, "enable_cache", None)):
        raise CacheSpecError(f"--cache {label}: {name} ({type(module).__name__}) is not a diffusers model with "
                             "enable_cache(); run without --cache")
    if getattr(module, "is_cache_enabled", False):
        raise CacheSpecError(f"--cache {label}: {name} has a cache enabled already; one cache at a time")
    config = diffusers_config(setting, steps)
    before = _hooked(module)
    try:
        module.enable_cache(config)
    except (ValueError, TypeError, KeyError) as exc:
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CacheSpecError(f"--cache {label}: diffusers refuses it on {name} ({type(module).__name__}): "
                             f"{why}") from None
    if _hooked(module) == before:
        module.disable_cache()
        hint = "; taylorseer:lite caches the blocks whole" if setting.kind == "taylorseer" and not setting.lite else ""
        raise CacheSpecError(f"--cache {label}: it hooks no module of {name} ({type(module).__name__}), so it would "
                             f"cache nothing{hint}")


def check_fits(setting: CacheSetting, spec, steps: int) -> None:
    """`setting` tried on the model's transformer built on the meta device (no weights, a second or two): refused
    (CacheSpecError) before anything is loaded where diffusers refuses it or it would hook nothing."""
    from chunkflow.models.build import construct_meta

    module = construct_meta(spec)
    enable_cache(module, setting, steps)
    module.disable_cache()


@dataclass
class BlockWatch:
    """Block calls of the watched transformers, per forward: computed (one of the block's own modules ran) or
    skipped; `remove()` takes the module hooks off."""

    skipped: list[list[str]] = field(default_factory=list)  # per forward: the blocks skipped
    computed: list[int] = field(default_factory=list)  # per forward: the blocks computed
    _ran: dict[str, bool] = field(default_factory=dict)  # block -> one of its own modules ran since its last exit
    _childless: set[str] = field(default_factory=set)  # blocks with no module of their own: counted as computed
    _handles: list = field(default_factory=list)

    def watch(self, root: nn.Module, blocks: list[tuple[str, nn.Module]]) -> "BlockWatch":
        """Count `root`'s forwards and its `blocks` (name, module) calls: hooks on the root, the blocks' exits and
        their children only (a pre-hook on a block itself would stand between its call and its forward, where the
        runtime then binds its weights at the call: runtime/skipping.py)."""
        self._handles.append(root.register_forward_pre_hook(lambda m, a: self._forward()))
        for name, block in blocks:
            self._handles.append(block.register_forward_hook(lambda m, a, out, name=name: self._left(name)))
            self._handles += [child.register_forward_pre_hook(lambda m, a, name=name: self._child(name))
                              for child in block.children()]
            if not any(True for _ in block.children()):
                self._childless.add(name)
        return self

    def _forward(self) -> None:
        self.skipped.append([])
        self.computed.append(0)

    def _child(self, name: str) -> None:
        self._ran[name] = True

    def _left(self, name: str) -> None:
        ran = self._ran.pop(name, False) or name in self._childless
        if not self.computed:  # a block called outside a watched forward
            self._forward()
        if ran:
            self.computed[-1] += 1
        else:
            self.skipped[-1].append(name)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


@dataclass
class CacheRun:
    """A cache in a run of a built pipeline (models/pipeline_build.BuiltPipeline): enabled on each of its
    transformers and watched; `mark()` where the measured generations begin, `result()` after them."""

    setting: CacheSetting
    names: list[str]
    watch: BlockWatch
    start: int = 0  # forwards watched before the measured generations
    bytes_before: dict[str, int] = field(default_factory=dict)  # each transformer's skipped_h2d_bytes then

    @classmethod
    def enable(cls, setting: CacheSetting, built, steps: int, log=lambda s: None) -> "CacheRun":
        """`setting` enabled on every transformer of `built` (Wan2.2-A14B's two experts each), each watched."""
        from chunkflow.models.adapters import find_blocks

        names, watch = built.names("transformer"), BlockWatch()
        try:
            for name in names:
                module = getattr(built.pipe, name)
                enable_cache(module, setting, steps, name)
                if setting.kind == "first-block":  # under torchrun: one decision from every rank's tokens
                    from chunkflow.cache_ranks import decide_across_ranks

                    try:
                        decide_across_ranks(module)
                    except CacheSpecError:
                        module.disable_cache()
                        raise
                where = {id(m): n for n, m in module.named_modules()}
                watch.watch(module, [(f"{name}.{where[id(b)]}", b) for b in find_blocks(module)])
        except CacheSpecError:
            watch.remove()  # a later transformer refused it: no hook of this run stays
            raise
        log(f"cache: {cache_label(setting)} on {', '.join(names)}")
        return cls(setting, names, watch)

    def mark(self, built) -> None:
        """The measured generations begin: what came before is not theirs."""
        self.start = len(self.watch.skipped)
        self.bytes_before = {n: built.handles[n].stats().skipped_h2d_bytes for n in self.names}

    def result(self, built, steps: int, generations: int):
        """What the cache skipped in the measured generations (reports.CacheResult)."""
        from chunkflow.reports import CacheResult

        skipped, computed = self.watch.skipped[self.start:], self.watch.computed[self.start:]
        by_block: dict[str, int] = {}
        for names in skipped:
            for n in names:
                by_block[n] = by_block.get(n, 0) + 1
        handles = [built.handles[n] for n in self.names]
        streams = any(h.cfg.streams for h in handles)
        wasted = sum(h.stats().skipped_h2d_bytes - self.bytes_before.get(n, 0) for n, h in zip(self.names, handles))
        per_step = max(1, round(len(skipped) / max(1, steps * generations)))
        return CacheResult(setting=self.setting, label=cache_label(self.setting), transformers=self.names,
                           forwards=len(skipped), forwards_per_step=per_step,
                           blocks_computed=sum(computed), blocks_skipped=sum(map(len, skipped)),
                           skipped_per_forward=[len(s) for s in skipped], skipped_by_block=by_block,
                           skipped_h2d_bytes=wasted if streams else None,
                           forwards_skipped=sum(1 for s in skipped if s),
                           measured_hit_rate=sum(1 for s in skipped if s) / len(skipped) if skipped else 0.0)

    def remove(self) -> None:
        self.watch.remove()


def resolve_cache(cache, plan, flag: str = "cache"):
    """A session's cache argument as a setting: "plan" the plan's (`plan --cache`, else none), None none, a
    `KIND[:PARAMS]` text parsed (CacheSpecError, one line, where it is bad), a CacheSetting as it is."""
    from chunkflow_planner.cache import parse_cache

    if cache == "plan":
        planned = plan.workload.cache
        return planned.setting if planned is not None else None
    if cache is None or not isinstance(cache, str):
        return cache
    return parse_cache(cache, flag)


@dataclass
class GenerationCache:
    """The step cache of a pipeline that generates many times (a session, a server, a prompt file): before each
    generation `begin(setting, steps)` enables the setting on every transformer (enabled again where it changed,
    or where MagCache's step count did: it keys on the generation's steps), resets its state (a generation stopped
    between steps leaves diffusers' cache state behind: the pipeline resets it only when its call ends) and marks
    the count; `result(steps)` after the generation is what it skipped there."""

    built: object  # models/pipeline_build.BuiltPipeline
    setting: CacheSetting | None = None
    steps: int | None = None
    run: CacheRun | None = None

    def begin(self, setting: CacheSetting | None, steps: int, log=lambda s: None) -> None:
        """`setting` (None: no cache) ready on the transformers for a generation of `steps` steps."""
        if setting != self.setting or (setting is not None and setting.kind == "mag" and steps != self.steps):
            self.end()
            if setting is not None:
                try:
                    self.run = CacheRun.enable(setting, self.built, steps, log)
                except CacheSpecError:  # refused on a later transformer: none keeps it
                    self._disable(self.built.names("transformer"))
                    raise
            self.setting, self.steps = setting, steps
        if self.run is None:
            return
        for name in self.run.names:
            getattr(self.built.pipe, name)._reset_stateful_cache()
        self.run.watch._ran.clear()  # a forward stopped mid-way leaves its blocks' notes open
        self.run.mark(self.built)

    def result(self, steps: int):
        """What the cache skipped in the generation since begin() (reports.CacheResult), None without one."""
        return self.run.result(self.built, steps, 1) if self.run is not None else None

    def end(self) -> None:
        """The cache off every transformer and the watch removed."""
        if self.run is not None:
            self.run.remove()
            self._disable(self.run.names)
        self.run, self.setting, self.steps = None, None, None

    def _disable(self, names: list[str]) -> None:
        for name in names:
            module = getattr(self.built.pipe, name)
            if getattr(module, "is_cache_enabled", False):
                module.disable_cache()
