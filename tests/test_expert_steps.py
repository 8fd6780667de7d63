"""The planner's split of the denoising steps between a pipeline's experts against diffusers' own scheduler: the
timesteps `set_timesteps` gives, counted as WanPipeline picks its expert (t >= boundary_ratio x
num_train_timesteps runs `transformer`)."""

from __future__ import annotations

import pytest

from chunkflow_planner.catalog import get_model
from chunkflow_planner.pipeline.experts import expert_steps


def _diffusers_split(pipe, steps: int) -> tuple[int, int]:
    """What WanPipeline does: its scheduler's timesteps, each run by `transformer` at t >= the boundary."""
    import diffusers

    sched = getattr(diffusers, pipe.scheduler.cls).from_config(pipe.scheduler.config)
    sched.set_timesteps(steps, device="cpu")
    boundary = pipe.boundary_ratio * sched.config.num_train_timesteps
    first = sum(1 for t in sched.timesteps if t >= boundary)
    return first, steps - first


@pytest.mark.parametrize("shift", [1.0, 3.0, 5.0, 8.0, 12.0])
@pytest.mark.parametrize("boundary", [0.875, 0.9, 0.5, 0.417])
def test_the_step_split_is_diffusers_schedulers(shift, boundary):
    base = get_model("wan2.2-a14b").pipeline
    cfg = {**base.scheduler.config, "flow_shift": shift}
    pipe = base.model_copy(update={"scheduler": base.scheduler.model_copy(update={"config": cfg}),
                                   "boundary_ratio": boundary})
    for steps in (1, 2, 3, 4, 7, 10, 20, 27, 30, 40, 50, 64, 100):
        assert expert_steps(pipe, steps) == _diffusers_split(pipe, steps), steps


def test_the_catalog_a14b_splits_unevenly_and_a_single_expert_runs_every_step():
    pipe = get_model("wan2.2-a14b").pipeline
    first, second = expert_steps(pipe, 40)
    assert (first, second) == _diffusers_split(pipe, 40) and first + second == 40 and first != second
    assert expert_steps(get_model("wan2.2").pipeline, 40) == (40,)
