"""What a bench measures: the sweep definition (`BenchSpec`), its points, and the metadata file it writes.

A sweep has three parts, all on one model and one hardware profile:
  scaling    every mode at every workload value (frames or batch), chunkflow at the first chunk size and
             residency (paper figure 3, and the breakdown of figure 4);
  chunk size chunkflow at every `chunk_sizes` entry, at one workload `chunk_at` (figure 5), with layerwise there;
  residency  chunkflow at every `residencies` entry, at one workload `residency_at` (figure 6), with none there.
Points shared by several parts are measured once: each configuration is offloaded once and run at the union of
its workloads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from chunkflow_planner.catalog import ModelSpec, Workload
from chunkflow_planner.errors import ChunkflowError
from chunkflow_planner.offload import MODES, OffloadConfig
from chunkflow_planner.versioned import read_versioned
from chunkflow_planner.workload import make_workload

BENCH_SCHEMA_VERSION = 1


class BenchError(ChunkflowError):
    """A sweep that cannot run or be read; the message says why."""


class BenchSpec(BaseModel):
    """The sweep: model, workload axis and values, modes, and the chunk-size and residency sweeps."""

    model: str
    axis: Literal["frames", "batch"]
    values: list[int]
    height: int | None = None
    width: int | None = None
    modes: list[str] = Field(default_factory=lambda: list(MODES))
    chunk_sizes: list[int] = Field(description="bytes; the first is the scaling chunk size")
    residencies: list[float] = Field(description="the first is the scaling residency")
    chunk_at: int | None = Field(None, description="workload of the chunk-size sweep (default: the middle value)")
    residency_at: int | None = Field(None, description="workload of the residency sweep (default: the smallest)")
    comm_aware: bool = Field(True, description="chunkflow paces chunk copies around collectives (SP only)")
    baselines: list[str] = Field(default_factory=list, description="other offloaders measured at every value, "
                                 "last (chunkflow.commands.bench.baselines)")
    compile: Literal["off", "regional", "regional-fullgraph"] = Field(
        "off", description="torch.compile the model's repeated blocks (diffusers' compile_repeated_blocks) before "
        "any configuration is offloaded; the planner's predictions stay those of eager execution")
    weight_dtype: Literal["bf16", "fp8_e4m3"] = Field("bf16", description="storage of the streamed weights in the "
                                                      "offload modes (none keeps the model as it is)")
    fp8_cast: Literal["compute", "copy"] = Field("compute", description="with fp8: where a streamed block is cast "
                                                 "to its compute dtype (the compute or the copy stream)")
    warmup: int = 1
    steps: int = 2

    @property
    def chunk(self) -> int:
        return self.chunk_sizes[0]

    @property
    def residency(self) -> float:
        return self.residencies[0]

    @property
    def chunk_value(self) -> int:
        return self.chunk_at if self.chunk_at is not None else self.values[(len(self.values) - 1) // 2]

    @property
    def residency_value(self) -> int:
        return self.residency_at if self.residency_at is not None else min(self.values)

    @property
    def has_chunk_sweep(self) -> bool:
        return len(self.chunk_sizes) > 1 and "chunkflow" in self.modes

    @property
    def has_residency_sweep(self) -> bool:
        return len(self.residencies) > 1 and "chunkflow" in self.modes

    def config(self, mode: str, chunk_bytes: int | None = None, residency: float | None = None) -> OffloadConfig:
        """A point's offload setting: chunkflow at the scaling chunk size and residency unless given."""
        dtype = "bf16" if mode == "none" else self.weight_dtype
        cast = self.fp8_cast if dtype != "bf16" else "compute"
        if mode != "chunkflow":
            return OffloadConfig(mode, comm_aware=self.comm_aware, weight_dtype=dtype, fp8_cast=cast)
        return OffloadConfig(mode, chunk_bytes or self.chunk, self.residency if residency is None else residency,
                             self.comm_aware, weight_dtype=dtype, fp8_cast=cast)

    def points(self) -> list[tuple[OffloadConfig, list[int]]]:
        """Each configuration once, with the workload values it runs at; none first, then layerwise, then chunkflow."""
        plan: dict[OffloadConfig, list[int]] = {}

        def add(cfg: OffloadConfig, v: int) -> None:
            vals = plan.setdefault(cfg, [])
            if v not in vals:
                vals.append(v)

        for m in self.modes:
            for v in self.values:
                add(self.config(m), v)
        if self.has_chunk_sweep:
            for m in ("none", "layerwise"):
                if m in self.modes:
                    add(self.config(m), self.chunk_value)
            for c in self.chunk_sizes:
                add(self.config("chunkflow", c), self.chunk_value)
        if self.has_residency_sweep:
            if "none" in self.modes:
                add(self.config("none"), self.residency_value)
            for r in self.residencies:
                add(self.config("chunkflow", residency=r), self.residency_value)
        order = {m: i for i, m in enumerate(MODES)}
        return sorted(((c, sorted(v)) for c, v in plan.items()), key=lambda cv: order[cv[0].mode])

    def n_points(self) -> int:
        return sum(len(v) for _, v in self.points()) + len(self.baselines) * len(self.values)

    def workload(self, spec: ModelSpec, value: int, steps: int = 1) -> Workload:
        kw: dict[str, Any] = dict(height=self.height, width=self.width, steps=max(1, steps), cfg_passes=1)
        return make_workload(spec, frames=value, **kw) if self.axis == "frames" else make_workload(spec, batch=value, **kw)


def row_label(mode: str, chunk_bytes: float | None, residency: float, weight_dtype: str = "bf16",
              fp8_cast: str = "compute") -> str:
    """The label of a bench.csv row: its offload setting's, or the baseline's name."""
    if mode not in MODES:
        return mode
    cfg = OffloadConfig.of_row(mode, chunk_bytes, residency)
    if weight_dtype != "bf16" and cfg.streams:
        cfg = cfg.with_overrides(weight_dtype=weight_dtype, fp8_cast=fp8_cast)
    return cfg.label


class BenchMeta(BaseModel):
    """bench.json: the sweep, the hardware profile the predictions used, and where and how it was measured."""

    schema_version: int = BENCH_SCHEMA_VERSION
    spec: BenchSpec
    hardware: dict = Field(description="the HardwareSpec predictions were made with (model_dump)")
    sp: int = 1
    gpu: str
    date: str
    command: str
    torch: str = ""
    diffusers: str = ""
    env: dict[str, str | None] = Field(default_factory=dict, description="NCCL settings that change the numbers")

    def write(self, path: Path) -> None:
        from chunkflow_planner.files import write_atomic

        write_atomic(path, self.model_dump_json(indent=2) + "\n")

    @staticmethod
    def read(path: Path) -> "BenchMeta":
        return read_versioned(path, BenchMeta, BENCH_SCHEMA_VERSION, what="bench file", error=BenchError,
                              remedy="run chunkflow bench again to write it")
