"""Ulysses sequence parallelism for the catalog models, on diffusers' context parallelism.

`init_distributed()` joins the torchrun job (nccl on CUDA, gloo on CPU); `enable_sequence_parallel(module,
spec, degree)` turns on diffusers' `ContextParallelConfig(ulysses_degree=degree)` for the module.

* Wan, FLUX and Qwen-Image: diffusers' own `_cp_plan` and its Ulysses attention (all-to-all through
  `torch.distributed._functional_collectives.all_to_all_single`), unchanged.
* HunyuanVideo has no `_cp_plan` in diffusers 0.42.1: models.yaml names chunkflow's own
  (`diffusers.cp_plan: hunyuan_video`, in chunkflow/models/hunyuan_video.py), which keeps diffusers' Ulysses
  all-to-all, so all four models issue the same collectives the same way, which is what communication awareness
  (runtime/comm.py) intercepts.
* CPU: diffusers' `_resolve_parallel_config` computes the device as `rank % torch.accelerator.device_count()`,
  which divides by zero on a machine without an accelerator. Everything else works on gloo. On CPU we resolve
  the config ourselves (the same three steps: a `("ring", "ulysses")` device mesh, `config.setup`, recording it
  on the model) through an instance attribute that shadows that one method for the duration of the
  `enable_parallelism` call; on CUDA diffusers' own path runs untouched.

Ulysses replicates weights: every rank holds (or, offloaded, streams) its own full copy; only activations are
split. Offload composes with it: call `chunkflow.offload` (or build with `build_transformer`) per rank, before
or after this function.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from chunkflow.launch import torchrun_world

__all__ = ["init_distributed", "enable_sequence_parallel", "first_failure"]


def init_distributed() -> tuple[int, int, torch.device]:
    """(rank, world size, device) of this process. Reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK);
    nccl when CUDA is available, gloo otherwise. Idempotent; without torchrun's variables: (0, 1, device)."""
    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), device
    world = torchrun_world()
    if world <= 1 or not dist.is_available():
        return 0, 1, device
    kw = {"device_id": device} if cuda else {}
    dist.init_process_group("nccl" if cuda else "gloo", **kw)
    return dist.get_rank(), dist.get_world_size(), device


def first_failure(message: str | None) -> tuple[int, str] | None:
    """Collective: every rank says what went wrong for it (None: nothing) and every rank learns the same answer,
    (rank, message) of the lowest rank that failed, or None when none did. For a refusal one rank cannot make
    alone: a rank that gave up while the others went on would leave them waiting in the next collective. Needs
    `init_distributed()` first (gloo: a CPU exchange; nccl: through the rank's device); one process: its own."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None if message is None else (0, message)
    said: list = [None] * dist.get_world_size()
    dist.all_gather_object(said, message)
    return next(((rank, m) for rank, m in enumerate(said) if m is not None), None)


# --------------------------------------------------------------------------------------------- enable


def enable_sequence_parallel(module: nn.Module, spec, degree: int) -> None:
    """Ulysses SP of `degree` over the default process group, on diffusers' context parallelism.

    `spec` is the model's `chunkflow_planner.catalog.ModelSpec` (used for its name in messages). degree 1 is a
    no-op. Needs `init_distributed()` first and world size == degree (one Ulysses group, no ring).
    """
    if degree == 1:
        return
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("sequence parallelism needs torch.distributed; call init_distributed() under torchrun")
    world = dist.get_world_size()
    if degree != world:
        raise ValueError(f"SP degree {degree} must equal the world size {world} (one Ulysses group)")
    heads = getattr(getattr(module, "config", None), "num_attention_heads", None)
    if heads is not None and heads % degree:
        raise ValueError(f"{spec.name}: {heads} attention heads are not divisible by the SP degree {degree}")
    from diffusers import ContextParallelConfig

    cp_plan = None
    cls = type(module).__name__
    if spec.diffusers.cp_plan is not None:  # models.yaml names our own plan for a class diffusers lacks one for
        from chunkflow.models.context_parallel import own_cp_plan

        cp_plan, proc = own_cp_plan(spec.diffusers.cp_plan)
        for m in module.modules():
            if isinstance(getattr(m, "processor", None), proc.__mro__[1]):
                m.set_processor(proc())
    elif getattr(module, "_cp_plan", None) is None:
        raise ValueError(f"{spec.name} ({cls}) has no context-parallel plan; sequence parallelism is not available")
    config = ContextParallelConfig(ulysses_degree=degree)
    if _accelerators() == 0:  # CPU / gloo: see the module docstring
        module._resolve_parallel_config = _cpu_resolver(module)
        try:
            module.enable_parallelism(config=config, cp_plan=cp_plan)
        finally:
            del module._resolve_parallel_config
    else:
        module.enable_parallelism(config=config, cp_plan=cp_plan)


def _accelerators() -> int:
    """Accelerators diffusers will see (torch.accelerator exists from torch 2.6; before it, CUDA only)."""
    acc = getattr(torch, "accelerator", None)
    return acc.device_count() if acc is not None else torch.cuda.device_count()


def _cpu_resolver(module):
    from diffusers.models._modeling_parallel import ParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    def resolve(config):
        config = ParallelConfig(context_parallel_config=config)
        cp = config.context_parallel_config
        mesh = cp.mesh or init_device_mesh("cpu", cp.mesh_shape, mesh_dim_names=cp.mesh_dim_names)
        config.setup(dist.get_rank(), dist.get_world_size(), torch.device("cpu"), mesh=mesh)
        module._parallel_config = config
        return config

    return resolve
