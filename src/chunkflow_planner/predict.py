"""The planner's prediction for one run configuration, and the hardware and workload a plan was made for.

`chunkflow run`, `chunkflow bench`, `calibrate --from-report` and the bench plots all compare measurements with
`predict(...)`; nothing outside the planner computes a prediction.
"""

from __future__ import annotations

from pydantic import BaseModel

from chunkflow_planner.catalog import HardwareSpec, ModelSpec, Workload
from chunkflow_planner.offload import OffloadConfig
from chunkflow_planner.overlap import analyse
from chunkflow_planner.plan import Plan
from chunkflow_planner.policy import Problem


class Predicted(BaseModel):
    """Step time and peak GPU memory the planner predicts for one configuration, and where the step goes."""

    step_time_s: float
    peak_memory_bytes: int
    pinned_host_bytes: int = 0
    regime: str = ""
    compute_s: float = 0.0
    collective_s: float = 0.0
    contention_stall_s: float = 0.0
    prefetch_stall_s: float = 0.0
    overhead_s: float = 0.0
    codec: str = "none"  # the codec of the configuration (offload.OffloadConfig.codec)
    codec_ratio: float | None = None  # the ratio it was priced at (tiers.codec_ratio)
    codec_ratio_measured: bool = False
    codec_raw_bytes: int = 0  # the host tier's streamed tails, raw, and encoded (a forward's copies; the host store)
    codec_stored_bytes: int = 0


def predict(spec: ModelSpec, w: Workload, hw: HardwareSpec, cfg: OffloadConfig, sp: int = 1) -> Predicted:
    """The planner's step time, memory and step breakdown for `w` on `hw` under `cfg` with Ulysses degree `sp`."""
    point = Problem(spec, w, hw, sp).evaluate(cfg)
    t = point.time
    codec = {}
    if cfg.codec != "none":
        from chunkflow_planner.tiers import codec_ratio

        ratio, measured = codec_ratio(hw)
        codec = dict(codec=cfg.codec, codec_ratio=ratio, codec_ratio_measured=measured,
                     codec_raw_bytes=int(point.memory.codec_raw), codec_stored_bytes=int(point.memory.codec_stored))
    return Predicted(**codec,
        step_time_s=point.step_time, peak_memory_bytes=point.memory.peak,
        pinned_host_bytes=int(point.memory.pinned_host), regime=analyse(spec, w, hw, sp, cfg=cfg).regime,
        compute_s=t.compute, collective_s=t.collective, contention_stall_s=t.contention_stall,
        prefetch_stall_s=t.prefetch_stall, overhead_s=t.overhead,
    )
