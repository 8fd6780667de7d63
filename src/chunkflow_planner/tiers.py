"""The memory tiers a weight byte can live in and what each costs, in one place: the policy (policy.py), the step
model (steptime.py, memory.py) and the whole-pipeline extension price every placement through these.

    tier   where the bytes live               to reach the GPU                   host memory held
    gpu    device memory, resident            nothing                            none
    host   pinned (page-locked) host memory   B / BW_h2d   (the host link, eq. 2)   B
    disk   the checkpoint's own files         B / BW_disk  (the disk's cold rate)   none (a small pinned ring)

BW_h2d is the hardware's per-GPU host-to-device rate (HardwareSpec.h2d_gbps) and BW_disk the disk's cold read rate
(HardwareSpec.disk_read_gbps, which `chunkflow calibrate --weights DIR` measures and `chunkflow plan --disk-gbps`
supposes). The paper has two tiers (its eq. 2 prices the host link); the disk is the third, priced the same way:
T_disk = B_disk / BW_disk (overlap.T_disk). What is read once a generation (a text encoder, the VAE) pays its tier's
read once; what is read every step (a streamed transformer block) pays it every forward, so the policy, choosing by
time, sends the former to disk first.

A codec (offload.OffloadConfig.codec, issue 39) changes how streamed bytes travel, not where they live:

    codec          on the link (eq. 2)          host memory held    on the GPU, each forward
    none           B / BW_h2d                   B                   nothing
    exponent-pack  rho B / BW_h2d               rho B               B / D decoded (sharing the SMs: the compute path)

The disk tier's blocks stream encoded too: the load reads their raw tails once (B / BW_disk), encodes them and
writes rho B to a spill file chunkflow owns (disk space, not host memory); each forward reads rho B from it
(rho B / BW_disk), copies rho B to the GPU and decodes B there, as the host tier's blocks do.

rho is the codec's ratio (stored / raw bytes: HardwareSpec.codec_ratio, which `chunkflow calibrate --weights DIR`
measures on the user's weights, else SUPPOSED_CODEC_RATIO) and D its decode rate (HardwareSpec.codec_decode_gbps,
bytes of decoded output per second; a profile without it cannot price the codec).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from chunkflow_planner.codec import SUPPOSED_CODEC_RATIO, codec_ratio, encoded_bytes  # noqa: F401 (their old home)
from chunkflow_planner.errors import ChunkflowError
from chunkflow_planner.overlap import GB, T_disk

if TYPE_CHECKING:
    from chunkflow_planner.catalog import HardwareSpec

TIERS = ("gpu", "host", "disk")
DISK_RATE_REMEDY = ("give `chunkflow plan --disk-gbps X` (the disk's cold read rate, GB/s) or run `chunkflow "
                    "calibrate --weights DIR` on this machine (it times the disk the checkpoint is on)")


CODEC_RATE_REMEDY = ("run `chunkflow calibrate` on this machine's GPU (it times the codec's decoder), or plan with "
                     "--hardware h200 or a profile that gives codec_decode_gbps; or leave the codec off (--codec off)")


class DiskRateUnknown(ChunkflowError):
    """The disk tier priced with a profile that has no disk read rate."""


class CodecRateUnknown(ChunkflowError):
    """The codec priced with a profile that has no decode rate."""


@dataclass(frozen=True)
class TierCost:
    """What `nbytes` of weights cost in a tier: seconds to bring them to the GPU once, and host memory held."""

    tier: str
    seconds: float
    host_bytes: float


def disk_known(hw: HardwareSpec) -> bool:
    """Whether the disk tier can be priced: the profile (or --disk-gbps) gives the disk's read rate."""
    return hw.disk_read_gbps is not None


def disk_rate(hw: HardwareSpec) -> float:
    """BW_disk in bytes per second; raises DiskRateUnknown (saying what to do) where the profile has none."""
    if hw.disk_read_gbps is None:
        raise DiskRateUnknown(f"the profile has no disk read rate to price the disk tier: {DISK_RATE_REMEDY}")
    return hw.disk_read_gbps * GB


def h2d_rate(hw: HardwareSpec) -> float:
    """BW_h2d in bytes per second (the host link shared out among its GPUs)."""
    return hw.h2d_gbps * GB


def read_s(nbytes: float, tier: str, hw: HardwareSpec) -> float:
    """Seconds to bring `nbytes` to the GPU from `tier` (0 for resident bytes)."""
    if tier == "gpu":
        return 0.0
    if tier == "host":
        return nbytes / h2d_rate(hw)
    if tier == "disk":
        return T_disk(nbytes, disk_rate(hw))
    raise ValueError(f"unknown tier {tier!r}; one of {TIERS}")


def host_held(nbytes: float, tier: str) -> float:
    """Host memory `nbytes` of weights hold in `tier`: all of them in pinned host memory, none elsewhere (a disk
    tier's ring is its reader's, priced by whoever reads)."""
    return float(nbytes) if tier == "host" else 0.0


def cost(nbytes: float, tier: str, hw: HardwareSpec) -> TierCost:
    """`nbytes` in `tier`: the read to the GPU and the host memory held."""
    return TierCost(tier, read_s(nbytes, tier, hw), host_held(nbytes, tier))


def codec_known(hw: HardwareSpec) -> bool:
    """Whether the codec can be priced: the profile gives its decode rate D."""
    return hw.codec_decode_gbps is not None


def decode_rate(hw: HardwareSpec) -> float:
    """D in bytes of decoded output per second; raises CodecRateUnknown (saying what to do) where the profile has
    none."""
    if hw.codec_decode_gbps is None:
        raise CodecRateUnknown(f"the profile has no decode rate to price the codec: {CODEC_RATE_REMEDY}")
    return hw.codec_decode_gbps * GB


def decode_s(nbytes: float, hw: HardwareSpec) -> float:
    """T_dec = B / D: seconds the GPU spends decoding `nbytes` of streamed weights (added to the compute path, eq. 1:
    the decode kernels share the SMs with the forward they overlap)."""
    return float(nbytes) / decode_rate(hw)
