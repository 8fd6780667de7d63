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
The VAE may decode tiled.

Per phase the prediction is its time and its peak GPU memory, where peak memory is what runs out: torch's peak
allocation, what the allocator keeps of freed activations (`alloc_slack`; memory.device_need) and the device memory
torch does not count (`context_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from chunkflow_planner.catalog import HardwareSpec
from chunkflow_planner.errors import ChunkflowError
from chunkflow_planner.memory import device_need
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
    text_encoders: tuple[str, ...]
    transformer: str
    vae: str
    vae_tiling: bool


@dataclass
class Phase:
    """One phase's predicted time and peak allocation (torch's bytes); `peak_memory` adds reserve and context."""

    time_s: float = 0.0
    allocated_bytes: float = 0.0
    detail: dict[str, float] = field(default_factory=dict)
    startup_s: float = 0.0  # part of time_s paid only by a process's first generation (PipelineProfile.startup_s)
    activation_bytes: float = 0.0  # of allocated_bytes, the activations (the allocator's slack scales with them)


@dataclass
class PipelineEstimate:
    placements: Placements
    transformer: Point
    phases: dict[str, Phase]
    host_bytes: dict[str, float]
    hw: HardwareSpec
    disk_bytes: dict[str, float] = field(default_factory=dict)  # bytes each component reads from disk a generation

    @property
    def disk_read(self) -> float:
        return sum(self.disk_bytes.values())

    def peak_memory(self, phase: str) -> int:
        """Device memory in use at the phase's peak: allocation, the allocator's slack over the activations (what
        it keeps mapped of freed ones, `alloc_slack`), its reserve and the context."""
        ph = self.phases[phase]
        return device_need(ph.allocated_bytes, ph.activation_bytes, self.hw)

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
    def host_memory(self) -> int:
        return int(sum(self.host_bytes.values()))
