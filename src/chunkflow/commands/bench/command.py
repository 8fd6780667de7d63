"""`chunkflow bench`: sweep a model's settings per offload mode, under torchrun for SP, and write the table and plots."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional
import sys

from rich.table import Table
import typer

from chunkflow.commands.app import console, UserError, _command, _progress
from chunkflow.commands.options import INPUT, OUTPUT, Device, Hardware, Height, OptionalModel, Width
from chunkflow.launch import torchrun_world
from chunkflow_planner.units import DEFAULT_CHUNK_BYTES, format_seconds, parse_size, short_bytes

if TYPE_CHECKING:  # annotations only
    from chunkflow.commands.bench.sweep import BenchSpec
    from chunkflow_planner.catalog import ModelSpec


def _int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{what} must be a comma-separated list of whole numbers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise UserError(f"{what} needs positive values, got {text!r}")
    return sorted(set(values))


def _bench_spec(model, frames, batch, modes, chunk_sizes, residency, chunk_at, residency_at, height, width, hardware,
                warmup, steps, comm_aware, baselines="", compile="off", weight_dtype="bf16", fp8_cast="compute"):
    """(ModelSpec, BenchSpec, HardwareSpec) from the bench flags, every value checked; UserError or ValueError."""
    from chunkflow.commands.bench import BenchSpec
    from chunkflow_planner.catalog import get_model
    from chunkflow_planner.planner import resolve_hardware

    if model is None:
        raise UserError("give --model (or --from-dir to redraw an earlier run)")
    spec = get_model(model)
    axis, values = _sweep_axis(spec, frames, batch)
    mode_list = _mode_list(modes)
    res = _residencies(residency)
    chunks = list(dict.fromkeys(parse_size(c) for c in chunk_sizes.split(",") if c.strip()))
    if not chunks:
        raise UserError(f"--chunk-sizes needs positive sizes, got {chunk_sizes!r}")
    _check_run_flags(steps, warmup, comm_aware, compile, weight_dtype, fp8_cast)
    base = _baseline_list(baselines)
    hw = resolve_hardware(hardware).spec
    aware = hw.pace_collectives if comm_aware == "auto" else comm_aware == "on"
    bench = BenchSpec(model=spec.name, axis=axis, values=values, height=height, width=width, modes=mode_list,
                      chunk_sizes=chunks, residencies=res, chunk_at=chunk_at, residency_at=residency_at,
                      comm_aware=aware, warmup=warmup, steps=steps, baselines=base, compile=compile,
                      weight_dtype=weight_dtype, fp8_cast=fp8_cast)
    _check_points(spec, bench, values, chunks)
    return spec, bench, hw


def _sweep_axis(spec: ModelSpec, frames: str | None, batch: str | None) -> tuple[str, list[int]]:
    """("frames" or "batch", the values to sweep): exactly one of --frames (video models) or --batch."""
    if (frames is None) == (batch is None):
        raise UserError("give exactly one of --frames (video models) or --batch")
    axis = "frames" if frames is not None else "batch"
    if axis == "frames" and not spec.is_video:
        raise UserError(f"{spec.name} is an image model: sweep --batch")
    return axis, _int_list(frames if frames is not None else batch, f"--{axis}")


def _mode_list(modes: str) -> list[str]:
    """The offload modes --modes names, each one the planner knows."""
    from chunkflow_planner.offload import MODES

    mode_list = [m.strip() for m in modes.split(",") if m.strip()]
    bad = [m for m in mode_list if m not in MODES]
    if bad or not mode_list:
        raise UserError(f"unknown mode(s) {', '.join(bad) or modes!r}; use {', '.join(MODES)}")
    return mode_list


def _residencies(residency: str) -> list[float]:
    """The residencies --residency names, in their order without repeats, each in [0, 1]."""
    try:
        res = list(dict.fromkeys(float(x) for x in residency.split(",") if x.strip()))
    except ValueError:
        raise UserError(f"--residency must be comma-separated fractions, got {residency!r}") from None
    if not res or any(not 0.0 <= r <= 1.0 for r in res):
        raise UserError(f"--residency values must be in [0, 1], got {residency!r}")
    return res


def _check_run_flags(steps: int, warmup: int, comm_aware: str, compile: str, weight_dtype: str,
                     fp8_cast: str) -> None:
    """The flags that say how each point runs: steps, warm-up, pacing, compilation and fp8 storage."""
    from chunkflow_planner.workload import MAX_STEPS

    if not 1 <= steps <= MAX_STEPS or not 0 <= warmup <= MAX_STEPS:
        raise UserError(f"--steps must be in [1, {MAX_STEPS}] and --warmup in [0, {MAX_STEPS}] (got {steps}, {warmup})")
    if comm_aware not in ("auto", "on", "off"):
        raise UserError(f"--comm-aware must be on, off or auto, got {comm_aware!r}")
    if compile not in ("off", "regional", "regional-fullgraph"):
        raise UserError(f"--compile must be off, regional or regional-fullgraph, got {compile!r}")
    if weight_dtype not in ("bf16", "fp8_e4m3"):
        raise UserError(f"--weight-dtype must be bf16 or fp8_e4m3, got {weight_dtype!r}")
    if fp8_cast not in ("compute", "copy"):
        raise UserError(f"--fp8-cast must be compute or copy, got {fp8_cast!r}")
    if fp8_cast != "compute" and weight_dtype == "bf16":
        raise UserError("--fp8-cast says where fp8-stored weights are cast; add --weight-dtype fp8_e4m3")


def _baseline_list(baselines: str) -> list[str]:
    """The other offloaders --baselines names, each known and runnable here."""
    from chunkflow.commands.bench.baselines import BASELINES, check_baseline

    base = [b.strip() for b in baselines.split(",") if b.strip()]
    if any(b not in BASELINES for b in base):
        raise UserError(f"unknown baseline(s) in {baselines!r}; known: {', '.join(BASELINES)}")
    for b in base:
        check_baseline(b)
    return base


def _check_points(spec: ModelSpec, bench: BenchSpec, values: list[int], chunks: list[int]) -> None:
    """Every workload the sweep runs and every chunk size checked against the model before any work."""
    from chunkflow_planner.plan_checks import offload_problem

    for v in {*values, bench.chunk_value, bench.residency_value}:
        bench.workload(spec, v)  # validates frames / batch / sizes
    for c in chunks:
        problem = offload_problem(bench.config("chunkflow", c), spec, "--chunk-sizes")  # validates chunk sizes
        if problem is not None:
            raise UserError(problem)

def _bench_table(df, spec, hw, axis: str, world: int) -> Table:
    from chunkflow.commands.bench.sweep import row_label

    t = Table(title=f"{spec.name}: measured vs predicted step time (hardware {hw.name}, SP={world})")
    for col in (axis, "config", "measured", "x none", "predicted", "error", "bit-identical"):
        t.add_column(col, justify="right")
    none = {r["value"]: r["measured_step_s"] for _, r in df[df["mode"] == "none"].iterrows()}
    for _, r in df.iterrows():
        label = row_label(r["mode"], r["chunk_bytes"], r["residency"], r.get("weight_dtype", "bf16"),
                          r.get("fp8_cast", "compute"))
        xn = f"{r['measured_step_s'] / none[r['value']]:.3f}" if r["value"] in none else "-"
        pred = ("-" if r["predicted_step_s"] != r["predicted_step_s"] else "- (nominal)" if hw.pipeline.device_is_host
                else format_seconds(r["predicted_step_s"]))
        err = "-" if r["err_step"] != r["err_step"] else f"{r['err_step']:+.1%}"
        t.add_row(str(r["value"]), label, format_seconds(r["measured_step_s"]), xn, pred, err, str(r["bit_identical"]))
    return t


_Frames = Annotated[Optional[str], typer.Option(help="video frame counts to sweep, e.g. 41,81,121")]
_Batch = Annotated[Optional[str], typer.Option(help="batch sizes to sweep (image models), e.g. 1,4,8")]
_Modes = Annotated[str, typer.Option(help="modes to run")]
_Baselines = Annotated[str, typer.Option(help="other offloaders to measure at every value, after the modes: "
                                              "diffusers-group (diffusers' group offloading, block level, streams)")]
_Compile = Annotated[str, typer.Option("--compile", help="torch.compile the repeated blocks before offloading "
                                       "(diffusers' compile_repeated_blocks): off, regional (fullgraph=False) or "
                                       "regional-fullgraph")]
_ChunkSizes = Annotated[str, typer.Option(help="chunkflow chunk sizes; the first is used across the workloads, all "
                                               "of them at --chunk-at, e.g. 16MB,4MB,64MB,256MB")]
_Residency = Annotated[str, typer.Option(help="chunkflow residencies; the first is used across the workloads, all "
                                              "of them at --residency-at, e.g. 0,0.2,0.4,0.6")]
_ChunkAt = Annotated[Optional[int], typer.Option(help="frames/batch of the chunk-size sweep (default: the middle "
                                                      "one)")]
_ResidencyAt = Annotated[Optional[int], typer.Option(help="frames/batch of the residency sweep (default: the "
                                                          "smallest)")]
_Warmup = Annotated[int, typer.Option(help="warm-up steps per point")]
_Steps = Annotated[int, typer.Option(help="timed steps per point (median), one forward each")]
_CommAware = Annotated[str, typer.Option(help="pace chunk copies around collectives (SP): on, off, or auto (on "
                                              "unless the hardware's peer link is NVLink, as the planner does)")]
_WeightDtype = Annotated[str, typer.Option(help="storage of the streamed weights in layerwise and chunkflow: bf16 "
                                                "or fp8_e4m3 (lossy: half the H2D bytes; none runs the model as it "
                                                "is)")]
_Fp8Cast = Annotated[str, typer.Option(help="with fp8_e4m3: cast each streamed block on the compute stream before "
                                            "it runs, or on the copy stream after its copies (copy)")]
_Out = Annotated[str, typer.Option("--out", "-o", help="directory for bench.csv, bench.json, summary.md and plots"),
                 OUTPUT]
_Plots = Annotated[bool, typer.Option("--plots/--no-plots", help="draw the plots (needs matplotlib)")]
_FromDir = Annotated[Optional[str], typer.Option("--from-dir", help="redraw plots and summary.md of an earlier bench "
                                                                    "directory (no model is run; writes to --out)"),
                    INPUT]


# the files bench writes in --out (plots.py draws the PNGs), checked before the sweep
OUTPUT_FILES = ("bench.csv", "bench.json", "summary.md", "bench.partial.csv", "step_time.png", "memory.png",
                "breakdown.png", "chunk_size.png", "residency.png", "accuracy.png", "roofline.png")


@_command("bench")
def bench_cmd(model: OptionalModel = None, frames: _Frames = None, batch: _Batch = None,
              modes: _Modes = "none,layerwise,chunkflow", baselines: _Baselines = "", compile: _Compile = "off",
              chunk_sizes: _ChunkSizes = short_bytes(DEFAULT_CHUNK_BYTES), residency: _Residency = "0",
              chunk_at: _ChunkAt = None, residency_at: _ResidencyAt = None, height: Height = None,
              width: Width = None, hardware: Hardware = None, device: Device = None, warmup: _Warmup = 1,
              steps: _Steps = 2, comm_aware: _CommAware = "auto", weight_dtype: _WeightDtype = "bf16",
              fp8_cast: _Fp8Cast = "compute", out: _Out = "bench", plots: _Plots = True,
              from_dir: _FromDir = None) -> None:
    """Sweep frames or batch, modes, chunk size and residency for a model; write CSV, summary and plots.

    Under torchrun (`torchrun --nproc-per-node N -m chunkflow bench ...`) every rank runs the sweep with
    Ulysses sequence parallelism of degree N; predictions are for SP=N and rank 0 writes the results.
    """
    from chunkflow_planner.files import check_output_dir, check_output_file

    check_output_dir(out, "--out")
    for name in OUTPUT_FILES if Path(out).expanduser().is_dir() else ():  # each a new name or a file to replace
        check_output_file(Path(out).expanduser() / name, "--out")
    if from_dir is not None:
        _bench_redraw(Path(from_dir), Path(out), plots)
        return
    world = torchrun_world()
    spec, bench, hw, dev = _bench_setup(world, device, model, frames, batch, modes, chunk_sizes, residency, chunk_at,
                                        residency_at, height, width, hardware, warmup, steps, comm_aware, baselines,
                                        compile, weight_dtype, fp8_cast)
    rank = 0
    if world > 1:
        from chunkflow.parallel import init_distributed

        rank, world, dev = init_distributed()
    df = _bench_measure(spec, bench, hw, dev, world, Path(out), show=rank == 0)
    if rank == 0:
        _bench_write(df, spec, bench, hw, dev, world, Path(out), plots)


def _bench_redraw(from_dir: Path, out: Path, plots: bool) -> None:
    """Plots and summary.md again from an earlier bench directory's files."""
    from chunkflow.commands.bench import load, write_outputs

    paths = write_outputs(*load(from_dir), out, plots)
    console.print("Written: " + ", ".join(str(p) for p in paths))


def _bench_setup(world: int, device: str | None, *flags):
    """(ModelSpec, BenchSpec, HardwareSpec, device) from the flags, every one checked before any work."""
    spec, bench, hw = _bench_spec(*flags)
    if world == 1:
        from chunkflow.runtime.resolve import resolve_device

        return spec, bench, hw, resolve_device(device, hint="--device cpu")
    if bench.baselines:
        raise UserError("--baselines run on one GPU; leave them out under torchrun")
    from chunkflow_planner.planner import check_parallel

    check_parallel(spec, hw, world)
    return spec, bench, hw, None  # each rank's device comes from init_distributed()


def _bench_measure(spec, bench, hw, dev, world: int, out_dir: Path, show: bool):
    """Run the sweep with a progress bar; while it runs, rank 0 keeps bench.partial.csv (what a sweep cut short by
    a time limit still leaves behind)."""
    from chunkflow.commands.bench import run_bench

    partial = out_dir / "bench.partial.csv"

    def keep_partial(rows: list[dict]) -> None:
        if show:
            import pandas as pd

            from chunkflow_planner.files import write_atomic

            out_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(partial, pd.DataFrame(rows).to_csv(index=False))

    with _progress() as bar:
        task = bar.add_task(f"{spec.name}: {bench.n_points()} points, SP={world}", total=bench.n_points(),
                            visible=show)
        df = run_bench(spec, bench, hw, device=dev, sp=world, progress=lambda: bar.advance(task),
                       log=(lambda s: bar.console.print(s, highlight=False)) if show else (lambda s: None),
                       on_row=keep_partial)
    if show:
        partial.unlink(missing_ok=True)
    return df


def _bench_write(df, spec, bench, hw, dev, world: int, out_dir: Path, plots: bool) -> None:
    """bench.csv, bench.json, summary.md and plots, then the table on the console."""
    import os

    from chunkflow.commands.bench import BenchMeta, write_outputs
    from chunkflow.commands.steps import environment

    env = environment(dev)
    launcher = f"torchrun --nproc-per-node {world} -m chunkflow " if world > 1 else "chunkflow "
    meta = BenchMeta(spec=bench, hardware=hw.model_dump(mode="json"), sp=world, gpu=env["gpu"], date=env["date"],
                     command=launcher + " ".join(sys.argv[1:]), torch=env["torch"], diffusers=env["diffusers"],
                     env={k: os.environ.get(k) for k in ("NCCL_P2P_DISABLE", "NCCL_NVLS_ENABLE", "CUDA_VISIBLE_DEVICES")})
    paths = write_outputs(df, meta, out_dir, plots)
    console.print("Written: " + ", ".join(str(p) for p in paths))
    console.print(_bench_table(df, spec, hw, bench.axis, world))
