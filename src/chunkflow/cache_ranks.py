"""First-block caching under sequence parallelism: one decision for all ranks, the one a single process makes.

diffusers' first-block cache decides after the first block whether to run the others: the absmean of the block's
residual against the last computed one's, over the absmean of that one (FBCHeadBlockHook), against the threshold.
Under sequence parallelism each rank holds a share of the tokens, so each would measure its share and the ranks
could decide differently (then wait on each other's collectives). Here each rank sums its share in float32, the
sums and counts are all-reduced, and every rank forms the two means in the residual's dtype and their ratio as
diffusers does in one process: the same figure on every rank, and one process's figure up to the order of a float32
sum (tests/test_generate_sp.py: the skips and latents of a single process, bit for bit).

The decision is the hook object's own method, replaced on that object: `transformer.disable_cache()` removes the
hook and the replacement with it.
"""

from __future__ import annotations

import torch
from torch import nn


def _head_hooks(module: nn.Module) -> list:
    """diffusers' first-block head hooks registered on `module` and the modules inside it."""
    from diffusers.hooks.first_block_cache import FBCHeadBlockHook

    return [h for m in module.modules() if getattr(m, "_diffusers_hook", None) is not None
            for h in m._diffusers_hook.hooks.values() if isinstance(h, FBCHeadBlockHook)]


def decide_across_ranks(module: nn.Module, group=None) -> int:
    """Every first-block head hook on `module` decides from all ranks' tokens (module docstring); returns how many
    hooks. Nothing to do outside an initialized process group of two or more."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) < 2:
        return 0
    hooks = _head_hooks(module)
    if not hooks or not all(callable(getattr(h, "_should_compute_remaining_blocks", None)) for h in hooks):
        from chunkflow_planner.cache import CacheSpecError

        raise CacheSpecError("--cache first-block under torchrun: this diffusers' first-block cache has no decision "
                             "chunkflow can share between the processes (each would decide alone, and they could "
                             "disagree and wait on each other); run it in one process, or use mag:ratios=...")
    for hook in hooks:
        hook._should_compute_remaining_blocks = _global_decision(hook, group)
    return len(hooks)


def _global_decision(hook, group):
    """The hook's decision from the sums of every rank's share (diffusers' _should_compute_remaining_blocks, its
    means taken over all ranks' tokens)."""
    import torch.distributed as dist

    @torch.compiler.disable
    def should_compute(residual: torch.Tensor) -> bool:
        state = hook.state_manager.get_state()
        prev = state.head_block_residual
        if prev is None:
            return True
        sums = torch.stack([(residual - prev).abs().sum(dtype=torch.float32).double(),  # as torch's mean sums
                            prev.abs().sum(dtype=torch.float32).double(),
                            torch.tensor(float(prev.numel()), dtype=torch.float64, device=prev.device)])
        dist.all_reduce(sums, group=group)
        absmean = (sums[0] / sums[2]).to(residual.dtype)
        prev_absmean = (sums[1] / sums[2]).to(residual.dtype)
        return (absmean / prev_absmean).item() > hook.threshold

    return should_compute
