"""What the whole-pipeline extension decides and estimates: a placement for every component, and a placement's
phases, times and memory.

Placements:
- `gpu`: on the GPU for the whole generation;
- `phase`: in (pinned) host memory, on the GPU for its own phase only (chunkflow parks it outside);
- `stream`: chunkflow streams its layers from pinned host memory (the transformer as the plan says; a text
  encoder layer by layer), parked outside its phase;
- `cpu`: runs on the CPU (text encoders);
- `disk`: read from the checkpoint's own files at its phase, nothing of it kept in host memory (tiers.py): a text
  encoder streamed layer by layer with every layer read at each use and its other tensors read at its phase, the
  VAE read whole onto the GPU at the decode, a transformer streamed with every block's tail on disk and its other
  tensors read at its turn. Offered only where the disk's rate is known (HardwareSpec.disk_read_gbps).
The VAE may decode tiled. A pipeline of several experts (Wan2.2-A14B) places each: all as `transformer` says, or,
where `experts` gives each its own, the one that runs fewer steps `disk` beside the other `stream` (it reads its
blocks at fewer forwards: the disk before what is read every step; the runtime streams both with one setting, the
disk one with every block on disk).

Per phase the prediction is its time and its peak GPU memory, where peak memory is what runs out: torch's peak
allocation, what the allocator keeps of freed activations (`alloc_slack`; memory.device_need) and the device memory
torch does not count (`context_bytes`).

Under Ulysses SP of degree n every rank runs the whole pipeline on its own GPU (each encodes the prompt and decodes
the latents; the transformer's steps and activations are its share of the SP forward): phases and placements are
one GPU's, each GPU with the same budget, and host memory is the host's (hostshare.py: what the ranks share once,
the rest once per rank).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from chunkflow_planner.catalog import HardwareSpec
from chunkflow_planner.errors import ChunkflowError
from chunkflow_planner.memory import device_need
from chunkflow_planner.pipeline.hostshare import HostSplit, host_split
from chunkflow_planner.policy import Point

PHASES = ("encode", "denoise", "decode")
TEXT_PLACEMENTS = ("gpu", "phase", "stream", "cpu", "disk")
TRANSFORMER_PLACEMENTS = ("gpu", "phase", "stream", "disk")
VAE_PLACEMENTS = ("gpu", "phase", "disk")
ON_DISK = "disk"  # the placement whose weights stay in the checkpoint's files


class PipelineError(ChunkflowError):
    """A model without a pipeline in the catalog, or a VAE without a decode measurement."""


@dataclass(frozen=True)
class Placements:
    """Every component's placement; `transformer` is its point's (every expert's unless `experts` gives each its
    own, in the pipeline's order: transformer, transformer_2)."""

    text_encoders: tuple[str, ...]
    transformer: str
    vae: str
    vae_tiling: bool
    experts: tuple[str, ...] = ()

    @classmethod
    def of(cls, text_encoders: tuple[str, ...], experts: tuple[str, ...], vae: str, vae_tiling: bool) -> Placements:
        """The placements with each expert's own (a plan's components): `transformer` the streamed one's where they
        differ."""
        if len(set(experts)) <= 1:
            return cls(text_encoders, experts[0], vae, vae_tiling)
        point_of = next((p for p in experts if p != ON_DISK), experts[0])
        return cls(text_encoders, point_of, vae, vae_tiling, tuple(experts))

    def of_experts(self, n: int) -> tuple[str, ...]:
        """The placement of each of `n` experts."""
        return self.experts or (self.transformer,) * n

    @property
    def mixed(self) -> bool:
        """Whether the experts are placed differently."""
        return len(set(self.experts)) > 1


@dataclass(frozen=True)
class ExpertRun:
    """One expert in a generation: its placement, its transformer point and the denoising steps it runs."""

    name: str
    placement: str
    point: Point
    steps: int

    def forwards(self, cfg_passes: int) -> int:
        """Its forwards a generation: a step's guidance passes, one where batched."""
        return self.steps * (1 if self.point.cfg.cfg_batched else cfg_passes)


@dataclass
class Phase:
    """One phase's predicted time and peak allocation (torch's bytes); `peak_memory` adds reserve and context."""

    time_s: float = 0.0
    allocated_bytes: float = 0.0
    detail: dict[str, float] = field(default_factory=dict)
    startup_s: float = 0.0  # part of time_s paid only by a process's first generation (PipelineProfile.startup_s)
    activation_bytes: float = 0.0  # of allocated_bytes, the activations (the allocator's slack scales with them)
    alloc_slack: float | None = None  # the slack measured for this phase's work (a VAE's decode), else the profile's


@dataclass
class PipelineEstimate:
    placements: Placements
    transformer: Point
    phases: dict[str, Phase]
    host_bytes: dict[str, float]
    hw: HardwareSpec
    disk_bytes: dict[str, float] = field(default_factory=dict)  # bytes each component reads from disk a generation
    experts: tuple[ExpertRun, ...] = ()  # each expert's placement, point and steps
    ranks: int = 1  # Ulysses SP degree: ranks on the host, each running the whole pipeline
    share_host: bool = True  # whether the ranks share the shareable host bytes (OffloadConfig.share_host)
    shared_bytes: dict[str, float] = field(default_factory=dict)  # of host_bytes, what the ranks can share, by holder

    @property
    def disk_read(self) -> float:
        return sum(self.disk_bytes.values())

    def peak_memory(self, phase: str) -> int:
        """Device memory in use at the phase's peak: allocation, the allocator's slack over the activations (what
        it keeps mapped of freed ones, `alloc_slack`), its reserve and the context."""
        ph = self.phases[phase]
        return device_need(ph.allocated_bytes, ph.activation_bytes, self.hw, ph.alloc_slack)

    @property
    def hw_word(self) -> str:
        """What messages call the device: 'GPU', or 'device' where it is the host CPU."""
        return "device" if self.hw.pipeline.device_is_host else "GPU"

    @property
    def gpu_need(self) -> int:
        return max(self.peak_memory(p) for p in PHASES)

    @property
    def binding_phase(self) -> str:
        return max(PHASES, key=self.peak_memory)

    @property
    def generation_time(self) -> float:
        return sum(p.time_s for p in self.phases.values())

    @property
    def host_split(self) -> HostSplit:
        """The host's memory split into what its ranks share and what each holds (hostshare.py, eq. H1)."""
        return host_split(self.host_bytes, self.shared_bytes, self.ranks, self.share_host)

    @property
    def host_memory(self) -> int:
        """Host bytes of the whole host: one process's with one rank, M_shared + n M_rank under SP (eq. H1)."""
        return self.host_split.per_host
