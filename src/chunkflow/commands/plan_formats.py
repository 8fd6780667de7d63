"""`chunkflow plan --format a,b,c`: the model planned in each stored format, one row a format (issue 52)."""

from __future__ import annotations

import json
import sys
from typing import Callable

from rich import box
from rich.console import Console
from rich.table import Table

from chunkflow.commands.app import UserError
from chunkflow_planner.plan import Plan
from chunkflow_planner.units import format_seconds

FORMAT_SLOT = "{format}"  # where --out puts each format's name when several are planned


def check_format_flags(text: str | None, out: str | None, weight_dtype: str,
                       allow_fp8: bool) -> tuple[list[str] | None, str | None]:
    """(the formats --format names or None, --out with one format's name filled in), checked with the flags they
    exclude: --out names one file a format (FORMAT_SLOT) when there are several, and fp8 storage casts no stored
    format."""
    from chunkflow_planner.formats import FormatError, parse_formats

    if text is None:
        if out and FORMAT_SLOT in out:
            raise UserError(f"--out {out!r} has {FORMAT_SLOT} in it, which --format fills: add --format, or name "
                            "one file")
        return None, out
    try:
        formats = parse_formats(text)
    except FormatError as exc:
        raise UserError(str(exc)) from None
    if len(formats) > 1 and out and FORMAT_SLOT not in out:
        raise UserError(f"--out {out!r} names one file and --format plans {len(formats)} formats: put {FORMAT_SLOT} "
                        f"in it (e.g. --out plan-{FORMAT_SLOT}.json, one plan file a format), or give one --format")
    if len(formats) == 1 and out and FORMAT_SLOT in out:
        out = out.replace(FORMAT_SLOT, formats[0])  # checked as the one file it is (plan.py writes to --out)
    if (weight_dtype == "fp8_e4m3" or allow_fp8) and any(f != "bf16" for f in formats):
        raise UserError("--weight-dtype fp8_e4m3 / --allow-fp8 cast bf16 weights to fp8; a stored format streams its "
                        "own bytes as they are: leave them out with --format (fp8-scaled is the stored float8 one)")
    return formats, out


def out_path(out: str | None, fmt: str) -> str | None:
    """The plan file of format `fmt`: --out with FORMAT_SLOT filled."""
    return None if out is None else out.replace(FORMAT_SLOT, fmt)


def show_formats(console: Console, spec, formats: list[str], plan_of: Callable, out: str | None,  # noqa: ANN001
                 json_out: bool) -> None:
    """Plan `spec` in each of `formats` (`plan_of` plans one model), then one row a format, or with --json one
    object by format (a plan, or why none fits); with --out, one plan file a format that fits."""
    from chunkflow_planner.formats import with_format
    from chunkflow_planner.policy import Infeasible

    results: dict[str, Plan | str] = {}
    for fmt in formats:
        try:
            results[fmt] = plan_of(with_format(spec, fmt), bool(out or json_out))[0]  # bands only where kept
        except Infeasible as exc:
            results[fmt] = str(exc)
    written = []
    for fmt, r in results.items():
        if isinstance(r, Plan) and out:
            r.write(out_path(out, fmt))
            written.append(out_path(out, fmt))
    if json_out:
        doc = {f: (json.loads(r.to_json()) if isinstance(r, Plan) else {"infeasible": r}) for f, r in results.items()}
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return
    console.print(formats_table(spec, results))
    for line in formats_notes(results):
        console.print(line, markup=False, highlight=False)
    for path in written:
        console.print(f"Plan written to {path}", markup=False)


def _gpu_peak(plan: Plan) -> int:
    """The plan's GPU need at its peak: the largest phase's (whole pipeline), else the transformer's allocation."""
    phases = plan.prediction.phases
    if phases is not None:
        return max(phases.encode.peak_memory_bytes, phases.denoise.peak_memory_bytes, phases.decode.peak_memory_bytes)
    return plan.prediction.peak_memory_bytes


def _step_bytes(plan: Plan) -> str:
    """H2D bytes a step and their share of bf16's (the same setting over the bf16 blocks), or "none"."""
    f = plan.format
    if f is None:  # bf16 itself: the bytes its setting streams
        from chunkflow_planner.format_plan import h2d_bytes_per_step
        from chunkflow_planner.plan import model_of

        moved = h2d_bytes_per_step(model_of(plan), plan.offload, plan.workload.to_workload())
        return f"{_gb(moved)} (1x)" if moved else "0"
    if f.h2d_bytes_per_step == 0:
        return "0"
    return f"{_gb(f.h2d_bytes_per_step)} ({f.h2d_bytes_per_step / f.h2d_bytes_per_step_bf16:.2f}x)"


def _gb(nbytes: float) -> str:
    """Bytes in GB, compact (the table's columns say the unit)."""
    return f"{nbytes / 1e9:.3g}" if nbytes < 1e11 else f"{nbytes / 1e9:.0f}"


def formats_table(spec, results: dict[str, Plan | str]) -> Table:  # noqa: ANN001
    """One row a format: bits a weight, fits, GPU peak, host memory, disk, bytes a step against bf16, decode a step,
    time (a generation, or a step for the transformer alone)."""
    from chunkflow_planner.formats import FORMATS, with_format

    whole = any(isinstance(r, Plan) and r.prediction.generation_time_s is not None for r in results.values())
    table = Table(title=f"{spec.name} by stored format, priced before the download (time: "
                        + ("a generation)" if whole else "a step)"), box=box.SIMPLE_HEAD, show_edge=False,
                  padding=(0, 0), pad_edge=False)
    for col in ("format", "bits", "fits", "GPU GB", "host GB", "disk GB", "H2D GB/step", "decode",
                "time"):
        table.add_column(col, justify="left" if col in ("format", "fits") else "right", no_wrap=True)
    experts = spec.pipeline.experts if spec.pipeline is not None else 1
    for fmt, r in results.items():
        bpw = f"{FORMATS[fmt].bits_per_weight:.3g}"
        disk = _gb(experts * with_format(spec, fmt).nbytes)
        if not isinstance(r, Plan):
            table.add_row(fmt, bpw, "no", "-", "-", disk, "-", "-", "-")
            continue
        p = r.prediction
        host = p.host_memory_bytes if p.host_memory_bytes is not None else p.pinned_host_bytes
        decode = "-" if r.format is None else format_seconds(r.format.decode_s_per_step) + (
            "" if r.format.decode_measured else "*")
        time = p.generation_time_s if p.generation_time_s is not None else p.step_time_s
        table.add_row(fmt, bpw, "yes", _gb(_gpu_peak(r)), _gb(host), disk, _step_bytes(r), decode,
                      format_seconds(time))
    return table


def _binding(message: str) -> str:
    """What binds, from an Infeasible's message ("GPU memory is the binding constraint: ...")."""
    head = message.split(":", 1)[0]
    for what, word in (("host memory", "host"), ("GPU memory", "GPU"), ("latency", "time")):
        if head.startswith(what):
            return word
    return "see below"


def formats_notes(results: dict[str, Plan | str]) -> list[str]:
    """What the rows rest on: the estimate's conventions, the decode rates supposed, and why each format that does
    not fit does not."""
    lines = ["H2D GB/step: host-to-device bytes a step (x: against the same setting over bf16's); decode: the "
             "GPU's dequantization a step; GPU: the peak phase's need; disk: the "
             "transformer's file(s) in the format (every expert); a GGUF estimate holds the blocks' 2-D "
             "weights quantized and the rest in F32 as city96's files do, non-block tensors in the model's dtype; a "
             "file's header gives the exact bytes (a Q4_K_M / Q5_K_M file mixes in Q6_K: a few percent more)"]
    if any(isinstance(r, Plan) and r.format is not None and not r.format.decode_measured for r in results.values()):
        lines.append("* decode supposed (a share of the GPU's memory bandwidth), not measured: `chunkflow calibrate` "
                     "on the GPU measures diffusers' dequantization of each format")
    for fmt, r in results.items():
        if not isinstance(r, Plan):
            lines.append(f"{fmt} does not fit ({_binding(r)}): {r}")
    return lines
