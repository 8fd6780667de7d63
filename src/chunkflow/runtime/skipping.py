"""Which block calls may bind their weights lazily, when the block's own forward begins (runtime/hooks.py): only
those a step cache of diffusers' may skip and where nothing else runs between the call and that forward.

A skipping cache (first-block, MagCache, TaylorSeer, SeaCache) replaces the forward a block's call runs with its
hook's `new_forward`, which decides from its own state and the inputs, never from the block's weights, and then
calls the block's own forward or returns a cached output. Binding at the call would wait for the block's copy and
prefetch the next even where the cache then skips it; binding when the forward begins spends nothing on a skipped
block. Anything else between the call and the forward may read or write the weights (a forward pre-hook, another
diffusers hook such as TextKVCache's, which runs the block's projections first), so there the block binds at its
call, as without a cache.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["binds_lazily", "SKIPPING_HOOKS"]

# diffusers' hook classes that only decide whether a block's forward runs (diffusers.hooks.*), by module and class
SKIPPING_HOOKS = {
    "diffusers.hooks.first_block_cache": ("FBCHeadBlockHook", "FBCBlockHook"),
    "diffusers.hooks.mag_cache": ("MagCacheHeadHook", "MagCacheBlockHook"),
    "diffusers.hooks.taylorseer_cache": ("TaylorSeerCacheHook",),
    "diffusers.hooks.sea_cache": ("SeaCacheLeaderBlockHook", "SeaCacheBlockHook"),
}


def _skipping(hook: object) -> bool:
    cls = type(hook)
    return cls.__name__ in SKIPPING_HOOKS.get(cls.__module__, ())


def binds_lazily(module: nn.Module) -> bool:
    """Whether a call of block `module` may leave its weights unbound until its own forward begins: no gradient is
    recorded, no forward pre-hook (its own or global) runs before that forward, and the hooks diffusers placed on
    it are skipping caches only, at least one."""
    if torch.is_grad_enabled() or module._forward_pre_hooks:
        return False
    if getattr(nn.modules.module, "_global_forward_pre_hooks", None):
        return False
    registry = module.__dict__.get("_diffusers_hook")
    hooks = list(getattr(registry, "hooks", {}).values()) if registry is not None else []
    return bool(hooks) and all(_skipping(h) for h in hooks)
