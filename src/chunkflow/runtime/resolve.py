"""What `offload()` is asked for, checked before the module is touched: the module, the device, the offload setting
(from a config, a plan or keywords), the block list and its parameters."""

from __future__ import annotations

import torch
from torch import nn

from chunkflow.runtime.errors import OffloadError, warn_user
from chunkflow.runtime.hooks import handle_of
from chunkflow_planner.offload import MODES, OffloadConfig, OffloadConfigError


def resolve_device(device: str | torch.device | None, hint: str = "device='cpu'") -> torch.device:
    """A torch.device to offload to; None: the current CUDA device if there is one, else the CPU. `hint` is how
    the caller spells "the CPU" (the API's device='cpu', the CLI's --device cpu)."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise OffloadError(f"device {device!r} is not a torch device ({exc}); use 'cuda', 'cuda:1' or 'cpu'") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise OffloadError(f"device {str(device)!r} requested but CUDA is not available on this machine; "
                               f"use {hint} to run the same logic on host memory")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise OffloadError(f"device {str(device)!r} is not supported; use 'cuda' or 'cpu'")
    return dev


class BlocksUnknown(OffloadError):
    """The module's blocks are needed (to stream them, or to check a plan against them) and were not given: the
    runtime takes its block list from its caller (chunkflow.offload finds it from the catalog)."""


def _unknown(module: nn.Module) -> BlocksUnknown:
    return BlocksUnknown(f"the blocks of this {type(module).__name__} were not given; pass blocks=[...] (e.g. "
                         "blocks=[model.blocks] or [model.transformer_blocks, model.single_transformer_blocks])")


def _flat(blocks) -> list[nn.Module]:
    flat: list[nn.Module] = []
    for b in blocks:
        flat.extend(b if isinstance(b, nn.ModuleList) else [b])
    return flat


def _plan_config(plan, module: nn.Module, blocks) -> OffloadConfig:
    """A plan's offload setting, after checking that the plan was made for this module's model: its class, and
    its architecture (the number of blocks and their parameters; a plan for a 5B model does not fit a 1.3B one)."""
    from chunkflow_planner.plan import load_plan, model_of

    try:
        p = load_plan(plan)
    except (ValueError, TypeError) as exc:
        raise OffloadError(str(exc)) from None
    spec = model_of(p)  # load_plan checked it is in the catalog or embedded
    cls = type(module).__name__
    if spec.diffusers.cls != cls:
        raise OffloadError(f"the plan is for {p.model.name} ({spec.diffusers.cls}) but the module is a {cls}; "
                           "write a plan for this model with `chunkflow plan`")
    _check_architecture(spec, module, blocks)
    return p.offload


def _block_params(block: nn.Module) -> int:
    """A block's own parameters, adapters (peft LoRA tensors) left out."""
    return sum(p.numel() for n, p in block.named_parameters() if "lora_" not in n)


def _check_architecture(spec, module: nn.Module, blocks) -> None:
    if blocks is None:
        raise _unknown(module)
    blocks = _flat(blocks)
    want = [spec.block_params(g) for g in spec.block_sequence()]
    have = [_block_params(b) for b in blocks]
    if have != want:
        raise OffloadError(
            f"the plan is for {spec.name}: {len(want)} blocks of {want[0] / 1e6:.1f}M parameters (first block), but "
            f"this {type(module).__name__} has {len(have)} blocks" + (f" of {have[0] / 1e6:.1f}M" if have else "")
            + "; it is another size of the model. Plan for this model (`chunkflow plan`), or offload with keywords")


def resolve_config(config=None, *, plan=None, module: nn.Module | None = None, blocks=None, mode: str | None = None,
                   chunk_size=None, residency: float | None = None,
                   comm_aware: bool | None = None, weight_dtype: str | None = None,
                   fp8_cast: str | None = None, disk_blocks: int | None = None,
                   codec: str | None = None, decode: str | None = None,
                   whole_blocks: tuple[int, ...] | None = None) -> OffloadConfig:
    """The OffloadConfig to run: `config` (an OffloadConfig, a plan or plan file, or a mode name) or `plan`, with
    any keyword laid over it; keywords alone build one. Plans are checked against `module`."""
    if config is not None and plan is not None:
        raise OffloadError("give the offload setting once: a config or plan as the second argument, or plan=")
    if isinstance(config, str) and config in MODES:
        config, mode = None, mode or config
    source = config if config is not None else plan
    try:
        if isinstance(source, OffloadConfig):
            base = source
        elif source is not None:
            base = _plan_config(source, module, blocks)
            if base.cfg_batched:
                warn_user(
                    "this plan assumes the two guidance passes of a step run as one batched forward (cfg_batched): "
                    "offload() streams the blocks either way, but the plan's step time holds only if the pipeline "
                    "is called inside chunkflow.batch_cfg(pipe) (as `chunkflow run` does); otherwise plan with "
                    "--cfg-batching off.")
        else:
            if weight_dtype is not None and not isinstance(weight_dtype, str):
                raise OffloadConfigError(f"weight_dtype must be 'bf16' or 'fp8_e4m3', got {weight_dtype!r}")
            if fp8_cast is not None and not isinstance(fp8_cast, str):
                raise OffloadConfigError(f"fp8_cast must be 'compute' or 'copy', got {fp8_cast!r}")
            return OffloadConfig(mode or "chunkflow", chunk_size, residency,
                                 True if comm_aware is None else comm_aware, weight_dtype=weight_dtype or "bf16",
                                 fp8_cast="compute" if fp8_cast is None else fp8_cast, disk_blocks=disk_blocks or 0,
                                 codec=codec or "none", decode=decode or "forward", whole_blocks=whole_blocks or ())
        return base.with_overrides(mode, chunk_size, residency, comm_aware, weight_dtype=weight_dtype,
                                   fp8_cast=fp8_cast, disk_blocks=disk_blocks, codec=codec, decode=decode,
                                   whole_blocks=whole_blocks)
    except OffloadConfigError as exc:
        raise OffloadError(str(exc)) from None


def resolve_blocks(module: nn.Module, blocks) -> list[tuple[str, nn.Module]]:
    """(name, block) pairs in execution order, from `blocks` (BlocksUnknown when None)."""
    names = {id(m): n for n, m in module.named_modules(remove_duplicate=False)}
    if blocks is None:
        raise _unknown(module)
    flat = _flat(blocks)
    out = []
    seen: set[int] = set()
    for b in flat:
        if not isinstance(b, nn.Module):
            raise OffloadError(f"blocks must be nn.Modules (or ModuleLists); got {type(b).__name__}")
        if id(b) not in names or b is module:
            raise OffloadError("every block must be a submodule of the offloaded module (and not the module itself)")
        if id(b) in seen:
            raise OffloadError(f"block {names[id(b)]!r} is listed twice")
        seen.add(id(b))
        out.append((names[id(b)], b))
    if not out:
        raise OffloadError("no blocks to offload; pass blocks=[...] with the transformer's block modules")
    inner = {id(m) for _, b in out for m in list(b.modules())[1:]}
    for n, b in out:
        if id(b) in inner:
            raise OffloadError(f"block {n!r} is inside another listed block; list disjoint blocks")
    return out


def check_not_offloaded(module: nn.Module) -> None:
    if handle_of(module) is not None:
        raise OffloadError("this module is already offloaded; call handle.remove() before offloading it again")


def unwrap_module(module) -> nn.Module:
    """The module to offload: a torch.compile wrapper (OptimizedModule) is offloaded through its _orig_mod."""
    if not isinstance(module, nn.Module):
        hint = ("; offload its transformer: chunkflow.offload(pipe.transformer, ...)"
                if isinstance(getattr(module, "transformer", None), nn.Module) else "")
        raise OffloadError(f"offload() takes an nn.Module, got {type(module).__name__}{hint}")
    inner = getattr(module, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) and type(module).__name__ == "OptimizedModule" else module


def check_whole_blocks(cfg: OffloadConfig, blocks: list[tuple[str, nn.Module]]) -> None:
    """Every block `cfg.whole_blocks` keeps whole is one of the module's (indices in the blocks' order)."""
    past = [i for i in cfg.whole_blocks if i >= len(blocks)]
    if past:
        raise OffloadError(f"whole_blocks {list(cfg.whole_blocks)} names block {past[0]}, but the module has "
                           f"{len(blocks)} block{'s' if len(blocks) != 1 else ''} (0-{len(blocks) - 1}); give indices "
                           "of its blocks in the order they run, or leave whole_blocks out")


def check_parameters(blocks: list[tuple[str, nn.Module]]) -> None:
    """Block parameters must be plain nn.Parameters, or GGUF-quantized ones streamed as stored
    (runtime/quantized.py); other parameter types (bitsandbytes, torchao, custom) cannot be streamed."""
    from chunkflow.runtime.quantized import streamable

    for name, b in blocks:
        for pname, p in b.named_parameters(recurse=True):
            if not streamable(p):
                raise OffloadError(f"parameter {name}.{pname} is a {type(p).__name__}, which chunkflow cannot stream "
                                   "(plain nn.Parameter, or diffusers' GGUFParameter from a GGUF file); offload a "
                                   "module without other quantized or custom parameters")
