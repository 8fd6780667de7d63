"""A pipeline's experts (Wan2.2-A14B's `transformer` and `transformer_2`): their names and how many of a
generation's denoising steps each runs.

diffusers' WanPipeline runs `transformer` at the timesteps t >= boundary_ratio * num_train_timesteps and
`transformer_2` at the others; its scheduler (UniPCMultistepScheduler with flow sigmas) spaces the timesteps as
`set_timesteps` does: sigmas = linspace(1, 1/N, steps + 1)[:-1], shifted s' = shift s / (1 + (shift - 1) s), the
first moved 1e-6 below 1, t = int64(s' N) (truncated). `expert_steps` counts them in plain Python with the same
floating-point operations (tests/test_expert_steps.py checks it against diffusers' scheduler).
"""

from __future__ import annotations

import struct

from chunkflow_planner.components import PipelineSpec
from chunkflow_planner.errors import ChunkflowError

FIRST_SIGMA_EPS = 1e-6  # diffusers' UniPCMultistepScheduler.set_timesteps: a first sigma of 1 is moved this far down
_UNMODELLED = ("use_dynamic_shifting", "shift_terminal", "use_karras_sigmas", "use_exponential_sigmas",
               "use_beta_sigmas")  # scheduler options that space the timesteps otherwise


class ExpertSplitError(ChunkflowError):
    """A pipeline of several experts whose scheduler spaces its timesteps in a way the planner does not model."""


def expert_names(experts: int) -> list[str]:
    """The pipeline attributes of its experts: transformer, transformer_2, ..."""
    return ["transformer" if k == 0 else f"transformer_{k + 1}" for k in range(experts)]


def _float32(x: float) -> float:
    """`x` rounded to float32: torch compares an int64 timestep with a Python float in the default dtype."""
    return struct.unpack("f", struct.pack("f", x))[0]


def expert_steps(pipe: PipelineSpec, steps: int) -> tuple[int, ...]:
    """Steps each expert runs of a `steps`-step generation, in the pipeline's order (module docstring): one expert
    runs them all; two split them at boundary_ratio * num_train_timesteps on the scheduler's timesteps."""
    if pipe.experts == 1:
        return (steps,)
    c = pipe.scheduler.config
    odd = [k for k in _UNMODELLED if c.get(k)]
    if pipe.boundary_ratio is None or not c.get("use_flow_sigmas") or odd:
        raise ExpertSplitError(f"{pipe.cls} with {pipe.experts} experts: the planner splits the steps on a "
                               "flow-sigma scheduler with a boundary_ratio and a fixed flow_shift; this one has "
                               f"{', '.join(odd) or 'no boundary_ratio or no flow sigmas'}")
    n, shift = c["num_train_timesteps"], c.get("flow_shift", 1.0)
    boundary = _float32(pipe.boundary_ratio * n)
    step = (1.0 / n - 1.0) / steps  # numpy.linspace(1, 1/n, steps + 1): i * step + 1
    first = 0
    for i in range(steps):
        s = i * step + 1.0
        s = shift * s / (1 + (shift - 1) * s)
        if i == 0 and abs(s - 1) < FIRST_SIGMA_EPS:
            s -= FIRST_SIGMA_EPS
        first += int(s * n) >= boundary
    return (first, steps - first)
