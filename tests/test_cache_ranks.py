"""First-block caching's decision under sequence parallelism (chunkflow/cache_ranks.py), in two gloo processes: each
holds half the tokens, and each decides what diffusers' own decision decides on the whole tensors in one process,
on both sides of the threshold, where each process deciding from its own half would not always agree."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("diffusers")

SHAPE = (2, 64, 16)  # batch, tokens, channels: the tokens split between the two ranks


def _hook(prev: torch.Tensor, threshold: float):
    """What the decision reads of diffusers' FBCHeadBlockHook: its state's last computed residual and threshold."""
    state = types.SimpleNamespace(head_block_residual=prev)
    return types.SimpleNamespace(state_manager=types.SimpleNamespace(get_state=lambda: state), threshold=threshold)


def _draws(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(residual, last residual) pairs in bf16, the halves unlike each other (one half moves more than the other)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        prev = torch.randn(SHAPE, generator=g).to(torch.bfloat16)
        move = torch.randn(SHAPE, generator=g) * torch.linspace(0.01, 0.6, SHAPE[1]).view(1, -1, 1)
        out.append(((prev.float() + move).to(torch.bfloat16), prev))
    return out


def _one_process(residual: torch.Tensor, prev: torch.Tensor) -> float:
    """diffusers' own figure on the whole tensors (FBCHeadBlockHook._should_compute_remaining_blocks)."""
    return ((residual - prev).abs().mean() / prev.abs().mean()).item()


def _rank(rank: int, init: str, out) -> None:
    from diffusers.hooks.first_block_cache import FBCHeadBlockHook

    from chunkflow.cache_ranks import _global_decision

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    got = []
    half = SHAPE[1] // 2
    for residual, prev in _draws(12):
        figure = _one_process(residual, prev)
        mine = slice(rank * half, (rank + 1) * half)
        for threshold in (figure * 0.99, figure * 1.01):
            whole = FBCHeadBlockHook._should_compute_remaining_blocks(_hook(prev, threshold), residual)
            shared = _global_decision(_hook(prev[:, mine], threshold), None)(residual[:, mine])
            alone = FBCHeadBlockHook._should_compute_remaining_blocks(_hook(prev[:, mine], threshold),
                                                                      residual[:, mine])
            got.append((whole, shared, alone))
    from chunkflow.cache_ranks import decide_across_ranks
    from chunkflow_planner.cache import CacheSpecError

    try:  # a module with no first-block hook to share (a diffusers that renamed it): refused, not left alone
        decide_across_ranks(torch.nn.Linear(2, 2))
        refused = False
    except CacheSpecError as exc:
        refused = "under torchrun" in str(exc) and "\n" not in str(exc)
    out.put((rank, (got, refused)))
    dist.destroy_process_group()


def test_every_rank_takes_the_one_process_decision_where_each_alone_would_not(tmp_path):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [ctx.Process(target=_rank, args=(r, init, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert all(refused for _, refused in results.values())
    results = {rank: got for rank, (got, _) in results.items()}
    for rank in (0, 1):
        assert all(whole == shared for whole, shared, _ in results[rank])  # one process's decision, either side
    decisions = [whole for whole, _, _ in results[0]]
    assert True in decisions and False in decisions
    # alone, the ranks' own halves would disagree with each other (the halves move unlike each other)
    assert any(a != b for (_, _, a), (_, _, b) in zip(results[0], results[1]))


def test_outside_a_process_group_nothing_is_replaced():
    from chunkflow.cache_ranks import decide_across_ranks

    assert not dist.is_initialized()
    assert decide_across_ranks(torch.nn.Linear(2, 2)) == 0
