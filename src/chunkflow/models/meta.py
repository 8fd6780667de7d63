"""What every component builder shares: a class constructed with its parameters on the meta device (buffers
computed as usual), its parameters swapped for meta ones of their final dtypes (ties kept), and random values for
them when there is no checkpoint."""

from __future__ import annotations

import contextlib

import zlib

import torch
from torch import nn

__all__ = ["params_on_meta", "swap_params", "param_dtype", "RandomSource", "INIT_STD"]

INIT_STD = 0.02


@contextlib.contextmanager
def params_on_meta():
    """Within: every registered parameter goes to the meta device; buffers are computed as usual (on CPU).

    Patches nn.Module.register_parameter for the duration (as accelerate's init_empty_weights does); not
    thread-safe, and restored on exit.
    """
    original = nn.Module.register_parameter

    def register(module, name, param):
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            p = module._parameters[name]
            module._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def param_dtype(module: nn.Module, name: str, dtype: torch.dtype) -> torch.dtype:
    """`dtype`, except float32 for modules the class keeps in fp32 (diffusers' `_keep_in_fp32_modules` rule)."""
    keep = getattr(module, "_keep_in_fp32_modules", None) or []
    return torch.float32 if any(k in name.split(".") for k in keep) else dtype


def swap_params(module: nn.Module, make) -> None:
    """Replace every Parameter by make(old); tied Parameters stay tied."""
    new: dict[int, nn.Parameter] = {}
    for m in module.modules():
        for attr, p in list(m._parameters.items()):
            if p is not None:
                if id(p) not in new:
                    new[id(p)] = make(p)
                m._parameters[attr] = new[id(p)]


class RandomSource:
    """normal(0, 0.02) weights, zero biases, unit norm weights: finite activations in bf16. Every parameter is
    drawn from a generator of its own, seeded by the seed and its name, so a seed gives the same weights in every
    mode and whichever tensors are drawn (a rank that takes the tensors another rank put in a shared host copy,
    runtime/tiers/shared.py, draws none of them); buffers keep their computed values."""

    def __init__(self, seed: int, device: torch.device, module: nn.Module):
        self.gen_device = device if device.type == "cuda" else torch.device("cpu")
        self.seed = seed
        self.params = {n for n, _ in module.named_parameters(remove_duplicate=False)}
        self.rules = {f"{p}.{a}" if p else a: self._rule(m, a) for p, m in module.named_modules(remove_duplicate=False)
                      for a, t in m._parameters.items() if t is not None}

    @staticmethod
    def _rule(module: nn.Module, attr: str) -> str:
        """How `fill` draws a parameter: "zero", "one" or "normal"."""
        if attr == "bias":
            return "zero"
        return "one" if "norm" in type(module).__name__.lower() and attr == "weight" else "normal"

    def fingerprint(self, name: str) -> str:
        """Everything tensor `name`'s values depend on besides its name, dtype and shape (runtime/digest.py): the
        rule, the seed and std, and the generator that draws them (its kind, the torch that implements it, and on CUDA
        the GPU, whose multiprocessor count sets how a draw is split). The draw is deterministic for these, so equal
        fingerprints prove equal values."""
        rule = self.rules.get(name, "normal")
        if rule != "normal":
            return f"random:{rule}"
        gen = f"cpu:{torch.backends.cpu.get_cpu_capability()}"
        if self.gen_device.type == "cuda":
            props = torch.cuda.get_device_properties(self.gen_device)
            gen = f"cuda:{props.name}:{props.major}.{props.minor}:{props.multi_processor_count}"
        return f"random:normal:{self.seed}:{INIT_STD}:{torch.__version__}:{gen}"

    def _generator(self, name: str) -> torch.Generator:
        return torch.Generator(device=self.gen_device).manual_seed(
            (self.seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (1 << 63))

    def provides(self, name: str) -> bool:
        return name in self.params

    def fill(self, name: str, module: nn.Module, attr: str, out: torch.Tensor) -> None:
        rule = self._rule(module, attr)
        if rule == "zero":
            out.zero_()
        elif rule == "one":
            out.fill_(1.0)
        elif out.device == self.gen_device:
            out.normal_(0.0, INIT_STD, generator=self._generator(name))
        else:  # into the host store: generate on the GPU, copy down
            tmp = torch.empty(out.shape, dtype=out.dtype, device=self.gen_device)
            tmp.normal_(0.0, INIT_STD, generator=self._generator(name))
            out.copy_(tmp)
