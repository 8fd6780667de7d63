"""The plan file: what the planner decided and predicted, read by the runtime and other tools.

A versioned pydantic schema written as JSON. Readers check `schema_version` and refuse others.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from chunkflow_planner.catalog import Workload
from chunkflow_planner.offload import OffloadConfig
from chunkflow_planner.versioned import read_versioned

PLAN_SCHEMA_VERSION = 1


class PlanError(ValueError):
    """A plan file that cannot be read; the message says why and what to do."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="allow")


class PlanModel(_Section):
    name: str
    n_blocks: int
    block_bytes_total: int
    non_block_bytes: int


class PlanWorkload(_Section):
    batch: int
    frames: int
    height: int
    width: int
    tokens: int = Field(description="global token count S per sample")
    steps: int
    cfg_passes: int = 1

    def to_workload(self) -> Workload:
        """The planner's Workload of this section (tokens are derived, not stored)."""
        return Workload(batch=self.batch, frames=self.frames, height=self.height, width=self.width, steps=self.steps,
                        cfg_passes=self.cfg_passes)


class PlanParallel(_Section):
    sp_degree: int = 1


class PlanHardware(_Section):
    name: str
    source: str = Field("", description="catalog, calibrated profile path, or default")
    peak_tflops: float
    h2d_gbps: float
    eta_comp: float
    eta_pref: float
    memory_bytes: int | None = None
    peer_link: str = "none"
    spec: dict | None = Field(None, description="the full hardware profile planned with (HardwareSpec fields)")


class Critical(_Section):
    axis: Literal["frames", "batch"]
    value: float | None = Field(description="continuous critical frames or batch; None when never reached")
    nearest_valid: int | None = None
    reason: str = ""


class Analysis(_Section):
    block_flops_per_gpu: float
    prefetch_bytes_per_block: float
    f_star: float
    i_block: float
    i_star: float
    t_comp_s: float
    t_pref_s: float
    eta_comp_used: float | None = Field(None, description="eta_comp at this F_block (the curve's value, if any)")
    regime: Literal["hidden", "exposed"]
    critical: Critical


class Prediction(_Section):
    step_time_s: float
    peak_memory_bytes: int
    pinned_host_bytes: int = 0


class Baselines(_Section):
    none: Prediction
    layerwise: Prediction


class PlanPrediction(Prediction):
    baselines: Baselines


class Plan(_Section):
    schema_version: int = PLAN_SCHEMA_VERSION
    model: PlanModel
    workload: PlanWorkload
    parallel: PlanParallel
    hardware: PlanHardware
    analysis: Analysis
    offload: OffloadConfig
    prediction: PlanPrediction
    memory_budget_bytes: int | None = None
    target_step_time_s: float | None = None
    reason: str = ""

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)

    def write(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")


def load_plan(source: str | Path | Plan) -> Plan:
    """A plan from a path (or a Plan, returned as is); a clear PlanError for anything unreadable."""
    if isinstance(source, Plan):
        return source
    path = Path(source)
    return read_versioned(path, Plan, PLAN_SCHEMA_VERSION, what="plan file", error=PlanError,
                          remedy=f"write it with `chunkflow plan --out {path}`")
