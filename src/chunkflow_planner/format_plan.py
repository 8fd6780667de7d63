"""What a plan records of its stored format (issue 52): the bytes it streams a step against bf16's, the decode a
step and the rates it was priced at (plan.PlanFormat). Apart from formats.py, which the memory model reads, so that
the plan's schema is not imported below it."""

from __future__ import annotations

from chunkflow_planner.catalog import HardwareSpec, ModelSpec, Workload
from chunkflow_planner.formats import block_decode_s, decode_gbps
from chunkflow_planner.memory import stored_volumes
from chunkflow_planner.offload import OffloadConfig, streaming_volumes
from chunkflow_planner.plan import PlanFormat
from chunkflow_planner.workload import per_forward


def bf16_of(spec: ModelSpec) -> ModelSpec:
    """`spec` in the model's own dtype: its stored format taken off (the blocks' bytes from their parameters)."""
    if spec.stored is None:
        return spec
    return spec.model_copy(update={"stored": None, "blocks": [g.model_copy(update={"stored": None})
                                                               for g in spec.blocks]})


def h2d_bytes_per_step(spec: ModelSpec, cfg: OffloadConfig, w: Workload) -> float:
    """Bytes `cfg` copies host to device in a step of `w`: each block's streamed bytes, once a forward."""
    passes = per_forward(w, cfg.cfg_batched)[1]
    return passes * sum(cfg.streamed_bytes(v) for v in streaming_volumes(cfg, stored_volumes(spec, cfg)))


def plan_format(spec: ModelSpec, cfg: OffloadConfig, w: Workload, hw: HardwareSpec) -> PlanFormat | None:
    """The plan's `format` section for `spec` run under `cfg`: None in the model's own dtype."""
    if spec.stored is None:
        return None
    base = bf16_of(spec)
    names = sorted({n for g in spec.blocks for n in g.stored.decoded})
    rates = {n: decode_gbps(n, hw) for n in names}
    passes = per_forward(w, cfg.cfg_batched)[1]
    st = spec.stored
    return PlanFormat(
        name=st.format, source=st.source, stored_bytes=st.nbytes, file_bytes=st.file_bytes, bf16_bytes=base.nbytes,
        block_bytes_ratio=spec.block_bytes_total / base.block_bytes_total,
        h2d_bytes_per_step=int(h2d_bytes_per_step(spec, cfg, w)),
        h2d_bytes_per_step_bf16=int(h2d_bytes_per_step(base, cfg, w)),
        decode_s_per_step=passes * sum(block_decode_s(g.stored, hw) for g in spec.block_sequence()),
        decode_gbps={n: r for n, (r, _) in rates.items()}, decode_measured=all(m for _, m in rates.values()),
        types=dict(st.types))
