"""Ulysses sequence parallelism for the catalog models, on diffusers' context parallelism.

`init_distributed()` joins the torchrun job (nccl on CUDA, gloo on CPU); `enable_sequence_parallel(module,
spec, degree)` turns on diffusers' `ContextParallelConfig(ulysses_degree=degree)` for the module.

* Wan, FLUX and Qwen-Image: diffusers' own `_cp_plan` and its Ulysses attention (all-to-all through
  `torch.distributed._functional_collectives.all_to_all_single`), unchanged.
* HunyuanVideo has no `_cp_plan` in diffusers 0.42.1. Its attention processor already goes through
  `dispatch_attention_fn(parallel_config=...)`, so we give it a `_cp_plan` of our own (`HUNYUAN_VIDEO_CP_PLAN`)
  and keep diffusers' Ulysses all-to-all. One thing the plan cannot express is its attention mask: the model
  builds a `[B, 1, 1, S_img + S_txt]` mask over the *full* joint sequence, while after the all-to-all each
  rank holds the keys in the order `[img_0, txt_0, img_1, txt_1, ...]` (every rank concatenates its own image
  and text shards). `HunyuanVideoUlyssesProcessor` (a subclass of diffusers' processor) permutes the mask into
  that order and leaves everything else to diffusers. This reuses diffusers' machinery (split/gather hooks,
  the all-to-all, the attention backends) instead of a second Ulysses implementation, so all four models issue
  the same collectives the same way, which is what communication awareness (runtime/comm.py) intercepts.
  The text length must be divisible by the degree (256 for HunyuanVideo: fine for 2, 4, 8).
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

__all__ = ["init_distributed", "enable_sequence_parallel", "HUNYUAN_VIDEO_CP_PLAN", "HunyuanVideoUlyssesProcessor"]


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
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or not dist.is_available():
        return 0, 1, device
    kw = {"device_id": device} if cuda else {}
    dist.init_process_group("nccl" if cuda else "gloo", **kw)
    return dist.get_rank(), dist.get_world_size(), device


# --------------------------------------------------------------------------------------------- HunyuanVideo


def _hunyuan_plan():
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    return {
        "rope": {  # (freqs_cos, freqs_sin), one row per image token
            0: ContextParallelInput(split_dim=0, expected_dims=2, split_output=True),
            1: ContextParallelInput(split_dim=0, expected_dims=2, split_output=True),
        },
        "transformer_blocks.0": {
            "hidden_states": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False),
            "encoder_hidden_states": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False),
        },
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }


def __getattr__(name):
    if name == "HUNYUAN_VIDEO_CP_PLAN":
        return _hunyuan_plan()
    if name == "HunyuanVideoUlyssesProcessor":
        return _hunyuan_processor_class()
    raise AttributeError(name)


_PROC = None


def _hunyuan_processor_class():
    global _PROC
    if _PROC is None:
        from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoAttnProcessor2_0

        class HunyuanVideoUlyssesProcessor(HunyuanVideoAttnProcessor2_0):
            """diffusers' processor, with the full-sequence mask permuted to the post-all-to-all key order."""

            def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                         image_rotary_emb=None):
                cp = self._parallel_config.context_parallel_config if self._parallel_config else None
                if attention_mask is not None and cp is not None and encoder_hidden_states is not None:
                    attention_mask = permute_joint_mask(attention_mask, hidden_states.shape[1],
                                                        encoder_hidden_states.shape[1], cp.ulysses_degree)
                return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)

        _PROC = HunyuanVideoUlyssesProcessor
    return _PROC


def permute_joint_mask(mask: torch.Tensor, img_local: int, txt_local: int, degree: int) -> torch.Tensor:
    """Full `[..., P*img + P*txt]` key mask -> the order `[img_0, txt_0, img_1, txt_1, ...]` (P = degree)."""
    n_img = img_local * degree
    if mask.shape[-1] != n_img + txt_local * degree:
        return mask  # already local or of another layout: leave it to diffusers
    img, txt = mask[..., :n_img], mask[..., n_img:]
    parts = []
    for r in range(degree):
        parts += [img[..., r * img_local:(r + 1) * img_local], txt[..., r * txt_local:(r + 1) * txt_local]]
    return torch.cat(parts, dim=-1)


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
        make_plan, processor_class = OWN_CP_PLANS[spec.diffusers.cp_plan]
        cp_plan = make_plan()
        proc = processor_class()
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


# chunkflow's own context-parallel plans, by the name models.yaml gives in `diffusers.cp_plan`
OWN_CP_PLANS = {"hunyuan_video": (_hunyuan_plan, _hunyuan_processor_class)}


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
