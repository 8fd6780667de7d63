"""Operators on the host CPU, for a component placed there: GEMMs at their shape's measured rate (`cpu_gemm_eta`,
a fraction of `cpu_tflops`), an attention as its two matmuls, memory passes at `cpu_mem_gbps`. The host dispatch of
an eager forward is priced apart (text.text_host_s). Pure Python: no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from chunkflow_planner.ops import TFLOP, Attention, Gemm, Op, efficiency_grid

if TYPE_CHECKING:
    from chunkflow_planner.catalog import HardwareSpec


def eta_cpu(hw: HardwareSpec, m: float, n: float, k: float) -> float:
    """Fraction of cpu_tflops a bf16 matmul of this shape achieves on the host CPU (the measured table, else 1)."""
    table = hw.pipeline.cpu_gemm_eta
    return efficiency_grid(table)(m, n, k) if table else 1.0


def cpu_op_time(op: Op, hw: HardwareSpec) -> float:
    """Seconds of one operator on the host CPU: GEMMs at their shape's measured rate, an attention as its two
    matmuls (q x kv x head dim), memory passes at cpu_mem_gbps (free where unmeasured)."""
    P = hw.pipeline.cpu_tflops * TFLOP
    if isinstance(op, Gemm):
        return op.flops / (P * eta_cpu(hw, op.m, op.n, op.k))
    if isinstance(op, Attention):
        return op.flops / (P * eta_cpu(hw, op.q, op.kv, op.hd))
    mem = hw.pipeline.cpu_mem_gbps
    return op.nbytes / (mem * 1e9) if mem else 0.0


def ops_time_cpu(ops: list[Op], hw: HardwareSpec) -> float:
    """Seconds of a list of operators on the host CPU (cpu_op_time), the per-operator host cost not included; an
    operator repeated (every layer of an encoder runs the same shapes) is priced once, the sum taken in order."""
    once: dict[Op, float] = {}
    times = [once[op] if op in once else once.setdefault(op, cpu_op_time(op, hw)) for op in ops]
    return sum(times)
