"""`chunkflow calibrate`: measure this machine's factors, save or print the profile, or refit one from run reports."""

from __future__ import annotations

from typing import Annotated, Optional

from rich.table import Table
import typer

from chunkflow.commands.app import console, UserError, _command, _progress, _say
from chunkflow.commands.options import INPUT, OUTPUT
from chunkflow.launch import torchrun_rank
from chunkflow_planner.units import format_bytes


_Models = Annotated[Optional[str], typer.Option("--model", "-m", help="catalog model(s) whose blocks set the eta_comp "
                                               "curves, comma-separated (e.g. wan2.2,flux,hunyuan; default wan2.2); "
                                               "each model listed gets its own curve"), INPUT]
_Out = Annotated[str, typer.Option("--out", "-o", help="write the hardware profile (YAML) here"), OUTPUT]
_Save = Annotated[Optional[bool], typer.Option("--save/--no-save", help="also save it as this machine's default "
                                                                        "profile (default: yes, except --cpu-smoke)")]
_CpuSmoke = Annotated[bool, typer.Option("--cpu-smoke", help="run every measurement tiny on the CPU (tests); the "
                                                             "numbers mean nothing")]
_FromReport = Annotated[Optional[list[str]], typer.Option("--from-report", help="refit instead of measuring: run "
                                                          "report(s) (.json, or .jsonl with one per line); repeat the "
                                                          "flag, or give a pattern: out/*-report.json"), INPUT]
_Profile = Annotated[Optional[str], typer.Option(help="with --from-report: the profile to refit (default: each "
                                                      "report's own)"), INPUT]
_GemmSize = Annotated[int, typer.Option(help="n of the n^3 bf16 GEMM")]
_PeakTflops = Annotated[Optional[float], typer.Option(help="P_peak to express eta against (default: the catalog GPU's "
                                                           "datasheet peak)")]
_Base = Annotated[Optional[str], typer.Option(help="catalog GPU whose unmeasured fields the profile inherits "
                                                   "(default: by GPU name)"), INPUT]
_Raw = Annotated[Optional[str], typer.Option(help="also write the raw measurements as JSON here"), OUTPUT]
_Weights = Annotated[Optional[str], typer.Option(help="time the disk this pipeline folder (or Hub id in the local "
                                                      "cache) is on, as the loader reads it, cold and warm (default: "
                                                      "the Hugging Face cache's disk), measure the lossless "
                                                      "codec's ratio on its transformer's weights (--codec), and time "
                                                      "its VAE's decodes where the catalog does not have that VAE"),
                    INPUT]
_VaeWeights = Annotated[Optional[list[str]], typer.Option(
    "--vae-weights", metavar="DIR", help="also time the VAE of this pipeline folder (or Hub id in the local cache) "
    "where the catalog does not have it, as --weights does; repeat the flag for several folders"), INPUT]
_StartupProcesses = Annotated[int, typer.Option(min=0, max=20, help="cold processes the start-up of a process's "
                                                 "first generation is measured over (each phase's first call less "
                                                 "its second; 0: not measured, the profile keeps its own)")]
_MoreReports = Annotated[Optional[list[str]], typer.Argument(metavar="REPORT", show_default=False, help="with "
                                                             "--from-report: more run reports (what an unquoted "
                                                             "pattern, --from-report out/*-report.json, expands to)"),
                        INPUT]


@_command("calibrate")
def calibrate_cmd(model: _Models = None, out: _Out = "profile.yaml", save: _Save = None, cpu_smoke: _CpuSmoke = False,
                  from_report: _FromReport = None, profile: _Profile = None, gemm_size: _GemmSize = 8192,
                  peak_tflops: _PeakTflops = None, base: _Base = None, raw: _Raw = None, weights: _Weights = None,
                  more_reports: _MoreReports = None, startup_processes: _StartupProcesses = 3,
                  vae_weights: _VaeWeights = None) -> None:
    """Measure this machine (GEMM rate, eta_comp curve of a real block, pinned H2D, and under torchrun the
    all-to-all and its contention with H2D) and write a hardware profile that `chunkflow plan` uses.

    Saving over this machine's default profile keeps the previous one beside it (hardware-profile.previous.yaml)
    and prints what changed."""
    import os

    from_report = _check_calibrate(model, cpu_smoke, from_report, more_reports, gemm_size, peak_tflops, raw,
                                   [weights] if weights is not None else [], vae_weights or [])
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as `run` measures
    default = save if save is not None else not cpu_smoke
    _check_outputs(out, raw, default, from_report, profile)
    if from_report:
        new, header = _refit_profile(from_report, profile)
    else:
        measured = _measure_profile(model or "wan2.2", cpu_smoke, gemm_size, peak_tflops, base, raw, weights,
                                    startup_processes, vae_weights or [])
        if measured is None:  # not rank 0
            return
        new, header = measured
    new = _save_profile(new, out, header, default=default, measured=not from_report)
    _print_profile(new)


def _check_calibrate(model: str | None, cpu_smoke: bool, from_report: list[str] | None,
                     more_reports: list[str] | None, gemm_size: int, peak_tflops: float | None, raw: str | None,
                     weights: list[str], vae_weights: list[str]) -> list[str]:
    """The measuring and refitting flags checked together; the run reports to refit from (flag and arguments)."""
    import math

    if gemm_size < 1:
        raise UserError(f"--gemm-size must be positive, got {gemm_size}")
    if peak_tflops is not None and not (math.isfinite(peak_tflops) and peak_tflops > 0):
        raise UserError(f"--peak-tflops must be a positive number, got {peak_tflops}")
    if cpu_smoke and model is not None:
        raise UserError("--cpu-smoke measures the tiny catalog model; leave --model out (it is for GPU runs)")
    if more_reports and not from_report:
        raise UserError(f"unexpected argument(s) {' '.join(more_reports)} (report files go after --from-report: "
                        "`chunkflow calibrate --from-report out/*-report.json`)")
    reports = (from_report or []) + (more_reports or [])
    if reports and (cpu_smoke or model is not None or raw is not None or weights or vae_weights):
        raise UserError("--from-report refits from run reports; --model, --cpu-smoke, --raw, --weights and "
                        "--vae-weights measure: use one or the other")
    if weights or vae_weights:
        from chunkflow.commands.calibrate.disk import disk_folder

        for folder in weights + vae_weights:  # a missing folder or uncached Hub id fails before anything is measured
            disk_folder(folder)
    return reports


def _check_outputs(out: str, raw: str | None, default: bool, reports: list[str], profile: str | None) -> None:
    """Every file calibrate writes can be written, and none is one it reads, known before the measurement."""
    import os

    from chunkflow_planner.files import check_distinct, check_output_dir, check_output_file
    from chunkflow_planner.planner import config_dir, saved_profile_path

    check_output_file(out, "--out")
    if raw:
        check_output_file(raw, "--raw")
    if default:  # where the default profile goes must take it
        check_output_dir(config_dir(), "chunkflow's config directory ($CHUNKFLOW_CONFIG_DIR)")
    previous = saved_profile_path().with_name("hardware-profile.previous.yaml") if default else None
    for path in (saved_profile_path(), previous) if default else ():
        if os.path.lexists(path):  # what is there must be a file to replace (not a FIFO or device)
            check_output_file(path, "the default profile" if path != previous else "the previous default profile")
    check_distinct({"--out": out, "--raw": raw, "the previous default profile": previous},
                   {**{f"--from-report {r}": r for r in reports}, "--profile": profile})


def _save_profile(new, out: str, header: str, default: bool, measured: bool = True):
    """The profile to `out`, and as this machine's default: the one it replaces is kept (read before anything is
    written, `out` being that same file or not), and what changed said. A measured profile saved over a default of
    the same GPU records how far each fit moved from it (bands.with_drift). Returns the profile written."""
    from chunkflow_planner.bands import drift_between, with_drift
    from chunkflow_planner.catalog import CatalogError, load_profile
    from chunkflow_planner.files import write_atomic
    from chunkflow_planner.planner import saved_profile_path

    from chunkflow.commands.calibrate.profile import profile_changes, write_profile

    path = saved_profile_path()
    previous = path.read_bytes() if default and path.is_file() else None
    try:
        old = load_profile(path) if previous is not None else None
    except CatalogError:
        old = None
    if measured and old is not None and (old.name, old.gpus, old.memory_bytes) == (new.name, new.gpus,
                                                                                   new.memory_bytes):
        moved = drift_between(old, new)
        new = with_drift(old, new, moved)
        if moved:
            console.print("moved since the previous calibration (root mean square of each fit's figures): " + ", ".join(
                f"{n} {d:.1%}" for n, d in moved.items()) + "; recorded as each fit's drift", highlight=False)
    write_profile(new, out, header)
    console.print(f"Profile written to {out}", markup=False)
    if not default:
        return new
    if previous is not None:
        kept = write_atomic(path.with_name("hardware-profile.previous.yaml"), previous)
        console.print(f"The previous default profile is kept as {kept}" + (
            "; changes: " + "; ".join(profile_changes(old, new)) if old is not None else " (it could not be read)"),
            highlight=False, markup=False)
    write_profile(new, path, header)
    console.print(f"Saved as this machine's default profile: {path} (`chunkflow plan` uses it without --hardware)",
                  markup=False)
    return new


def _refit_profile(reports: list[str], profile: str | None):
    """(refitted profile, header) from run reports; notes printed. Reports that cannot describe a GPU are refused."""
    from chunkflow_planner.catalog import HardwareSpec, get_hardware

    from chunkflow.commands.calibrate.host import CalibrationError
    from chunkflow.commands.calibrate.refit import check_refit_reports, read_reports, refit

    import glob
    import os

    paths = []
    for given in reports:  # a quoted pattern (`--from-report 'out/*-report.json'`) is expanded here
        if any(c in given for c in "*?["):
            found = sorted(glob.glob(given))
            if not found:
                raise CalibrationError(f"--from-report {given!r} matches no file")
            paths += found
        else:
            paths.append(given)
    unique: dict[str, str] = {}  # each file once, where patterns overlap
    for path in paths:
        unique.setdefault(os.path.realpath(path), path)
    paths = list(unique.values())
    reps = []
    for path in paths:  # one at a time, so a refused report is named
        these = read_reports([path])
        check_refit_reports(these, [path])
        reps += these
    reports = paths
    if profile:
        hw = get_hardware(profile)
    else:
        try:
            hw = HardwareSpec(**(reps[0].plan.hardware.spec or {}))
        except (TypeError, ValueError) as exc:
            raise CalibrationError(f"the first run report's plan has no usable hardware profile ({exc}); pass "
                                   "--profile") from None
    new, notes = refit(hw, reps)
    for n in notes:
        console.print(f"- {n}", highlight=False)
    return new, f"refit from {', '.join(reports)}"


def _measure_profile(model: str, cpu_smoke: bool, gemm_size: int, peak_tflops: float | None, base: str | None,
                     raw: str | None, weights: str | None = None, startup_processes: int = 3,
                     vae_weights: list[str] | None = None):
    """(measured profile, header) on rank 0; None on other ranks under torchrun (every rank measures)."""
    import json

    from chunkflow_planner.files import write_atomic

    from chunkflow.commands.calibrate.measure import calibrate

    rank0 = torchrun_rank() == 0
    with _progress() as bar:
        def progress(desc, total):
            task = bar.add_task(desc, total=total, visible=rank0)
            return lambda: bar.advance(task)

        cal = calibrate(model, cpu_smoke=cpu_smoke, gemm_n=gemm_size, peak_tflops=peak_tflops, base=base,
                        progress=progress, weights=weights, startup_processes=startup_processes,
                        vae_weights=vae_weights or (),
                        log=_say if rank0 else (lambda s: None))
    if not rank0:
        return None
    if raw:
        write_atomic(raw, json.dumps(cal.raw, indent=2, default=str) + "\n")
    header = "measured by chunkflow calibrate" + (" --cpu-smoke (not a GPU: numbers mean nothing)" if cpu_smoke else "")
    return cal.profile, header


def _print_profile(hw) -> None:
    t = Table(title=f"Hardware profile {hw.name}")
    t.add_column("field")
    t.add_column("value", justify="right")
    for key in ("peak_tflops", "gemm_tflops", "eta_comp", "h2d_link_gbps", "dma_startup_us", "eta_pref",
                "coll_gbps", "contention", "block_overhead_us", "hbm_gbps", "fp8_cast_gbps", "mem_ops_scale", "cpu_tflops",
                "encode_host_s", "host_margin", "postprocess_gbps", "alloc_slack", "reserve_fraction",
                "mem_margin", "disk_read_gbps", "codec_ratio", "codec_decode_gbps", "page_cache_gbps", "pin_gbps", "host_fault_gbps", "load_startup_s",
                "libraries_warm_share"):
        v = hw.figure(key)
        t.add_row(key, "-" if v is None else f"{v:.4g}")
    if hw.format_decode_gbps:
        t.add_row("format_decode_gbps", ", ".join(f"{k} {v:.4g}" for k, v in hw.format_decode_gbps.items()))
    t.add_row("context_bytes", format_bytes(hw.context_bytes))
    t.add_row("process_host_bytes", format_bytes(hw.pipeline.process_host_bytes))
    if hw.pipeline.process_start_host_bytes is not None:
        t.add_row("process_start_host_bytes", format_bytes(hw.pipeline.process_start_host_bytes))
    if hw.pipeline.startup_s:
        t.add_row("startup_s", ", ".join(f"{k} {v:.3f}" for k, v in hw.pipeline.startup_s.items()))
    if hw.pipeline.text_layer_host_us:
        t.add_row("text-encoder layer host", ", ".join(f"{a} {us:.0f} us" for a, us in hw.pipeline.text_layer_host_us.items()))
    if hw.eta_comp_curve:
        t.add_row("eta_comp(F)", "; ".join(f"{f:.2e}: {e:.3f}" for f, e in hw.eta_comp_curve))
    if hw.gemm_eta:
        t.add_row("GEMM / attention shapes", f"{len(hw.gemm_eta)} / {len(hw.attn_eta or [])} measured")
    for name, fit in hw.pipeline.vae_decode.items():
        t.add_row(f"VAE {name}", _vae_words(fit))
    console.print(t)
    _print_fits(hw)


def _vae_words(fit) -> str:
    """A VAE decode fit in one line: memory, rate, allocator slack, and its tiled fit's."""
    slack = lambda f: "" if f.alloc_slack is None else f"; allocator slack {f.alloc_slack:.2f}"  # noqa: E731
    words = (f"{fit.mem_const / 1e9:.2f} GB + {fit.mem_per_px:.0f} B/px + {fit.mem_per_voxel:.1f} B/voxel; "
             f"{fit.time_per_voxel * 1e9:.2f} ns/voxel" + slack(fit))
    if fit.tiled is None:
        return words
    tiled = f"; tiled {fit.tiled.time_per_call * 1e3:.1f} ms/decoder call" if fit.tiled.time_per_call else " (+tiled)"
    return words + tiled + slack(fit.tiled)


def _print_fits(hw) -> None:
    """The profile's fits (samples, spread, flag) and the planner's errors from run reports, each flagged fit with
    what to measure again; nothing where the profile has neither."""
    from chunkflow_planner.bands import FLAG_SPREAD

    if hw.fits:
        from chunkflow_planner.bands import FITS

        t = Table(title="Fits (robust spread of a sample; drift: from one calibration to the next)")
        for col, justify in (("fit", "left"), ("samples", "right"), ("spread", "right"), ("drift", "right"),
                             ("flagged", "left")):
            t.add_column(col, justify=justify)
        for name, q in hw.fits.items():
            drift = (f"+-{q.drift * 100:.1f}% ({q.drift_pairs} pair{'s' if q.drift_pairs != 1 else ''})"
                     if q.drift is not None else f"+-{FITS[name].drift_prior * 100:.1f}% (prior)"
                     if FITS[name].drift_prior else "in the spread (from runs)")
            t.add_row(name, str(q.samples), f"+-{q.spread * 100:.1f}%", drift, "too wide" if q.flagged else "")
        console.print(t)
        if any(q.drift is None and FITS[n].drift_prior for n, q in hw.fits.items()):
            console.print("drift (prior): not measured on this machine yet; calibrating again, saved over this "
                          "profile, measures how far its figures move between runs", highlight=False)
        for name, q in hw.fits.items():
            if q.flagged:
                console.print(f"fit {name}: +-{q.spread * 100:.1f}% is too wide to plan with (over "
                              f"+-{FLAG_SPREAD * 100:.0f}%); measure again: {q.repeat}", highlight=False, markup=False)
    if hw.model_errors:
        t = Table(title="The planner's errors in run reports (measured / predicted - 1)")
        for col in ("prediction", "errors", "reports", "bias", "spread"):
            t.add_column(col, justify="left" if col == "prediction" else "right")
        for kind, e in hw.model_errors.items():
            t.add_row(kind, str(e.samples), str(e.reports), f"{e.bias * 100:+.1f}%", f"+-{e.spread * 100:.1f}%")
        console.print(t)
