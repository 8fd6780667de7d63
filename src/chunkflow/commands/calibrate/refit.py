"""`chunkflow calibrate --from-report`: adjust a profile from `chunkflow run` reports (eta_comp from `none` runs, the
block overhead, start-ups, the pipeline's host factors, the load's rates)."""

from __future__ import annotations

import datetime
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from pydantic import ValidationError

from chunkflow.commands.calibrate.fit import compute_ratio, gmean, scaled_curve
from chunkflow.commands.calibrate.host import CalibrationError
from chunkflow_planner.catalog import EFFICIENCY_RANGE, HardwareSpec, ModelSpec
from chunkflow_planner.predict import predict


def check_refit_reports(reports: Sequence, paths: Sequence[str]) -> None:
    """Refuse reports that cannot describe a GPU: runs on the CPU (their times say nothing about the profile's
    GPU). Times are finite and positive already (the report schema)."""
    for r in reports:
        if r.run.device.startswith("cpu") or r.gpu.startswith("cpu"):
            raise CalibrationError(f"the run report in {', '.join(paths)} was measured on the CPU ({r.gpu}); a refit "
                                   "needs runs on the GPU the profile describes (nothing was changed)")


def read_reports(paths: Sequence[str | Path]) -> list:
    """RunReports from .json / .jsonl files (chunkflow.reports.load_reports), with CalibrationError for bad input."""
    from chunkflow.reports import RunError, load_reports

    try:
        return load_reports(paths)
    except RunError as exc:
        raise CalibrationError(str(exc)) from None


def _key(rep) -> tuple:
    w = rep.plan.workload
    return (rep.plan.model.name, w.batch, w.frames, w.height, w.width, w.cfg_passes, rep.run.sp_degree,
            rep.run.offload.cfg_batched)



def _refit_eta(hw: HardwareSpec, none: dict, notes: list[str]) -> dict[str, Any]:
    """eta_comp (scalar, curve, per-model curves) scaled by predicted / measured compute of the `none` runs."""
    from chunkflow_planner.plan import model_of

    ks: dict[str, list[float]] = {}
    for r in none.values():
        spec = model_of(r.plan)
        k = compute_ratio(spec, r.plan.workload.to_workload(), hw, r.run.offload, r.measured.median_step_s,
                          r.run.sp_degree)  # none, as it ran
        if k is not None:
            ks.setdefault(spec.name, []).append(k)
    if not ks:
        notes.append("no `none` run: eta_comp unchanged")
        return {}
    k = gmean([x for xs in ks.values() for x in xs])
    lowest = min([hw.eta_comp] + [e for _, e in hw.eta_comp_curve or []]) * k
    if lowest < EFFICIENCY_RANGE[0]:
        raise CalibrationError(
            f"the `none` runs measured compute {1 / k:.3g}x slower than profile {hw.name!r} predicts, which puts "
            f"eta_comp at {lowest:.2g}, below the {EFFICIENCY_RANGE[0]:g} a GPU plausibly reaches: were these "
            "runs measured on this GPU? Refit from reports of this machine, or run `chunkflow calibrate`.")
    update: dict[str, Any] = {"eta_comp": min(1.0, hw.eta_comp * k)}
    if hw.eta_comp_curve:
        update["eta_comp_curve"] = scaled_curve(hw.eta_comp_curve, k)
    notes.append(f"eta_comp x{k:.3f} from {sum(map(len, ks.values()))} `none` run(s): "
                 f"{hw.eta_comp:.3f} -> {update['eta_comp']:.3f}")
    curves = dict(hw.eta_comp_curves)
    for name, xs in ks.items():  # a model with its own curve is scaled by its own runs
        if name in curves:
            km = gmean(xs)
            curves[name] = scaled_curve(curves[name], km)
            notes.append(f"eta_comp curve of {name} x{km:.3f} from {len(xs)} `none` run(s)")
    if curves != hw.eta_comp_curves:
        update["eta_comp_curves"] = curves
    return update


def _refit_overhead(hw: HardwareSpec, reports: Sequence, none: dict, notes: list[str], fits: dict[str, Any]
                    ) -> dict[str, Any]:
    """block_overhead_us from offload-vs-none gaps where the prefetch is predicted hidden; with 2 gaps or more, its
    FitQuality into `fits` (each gap / the value written - 1: _refit_quality)."""
    from chunkflow_planner.plan import model_of

    gaps = []
    for r in reports:
        if r.run.offload.mode == "none" or _key(r) not in none or r.run.offload.weight_dtype != "bf16":
            continue  # an fp8 run's gap also holds the cast, which the step model counts as compute
        spec = model_of(r.plan)
        p = predict(spec, r.plan.workload.to_workload(), hw, r.run.offload, r.run.sp_degree)
        if p.prefetch_stall_s > 0.01 * p.step_time_s:
            continue  # prefetch exposed: the gap is transfer, not overhead
        n = (r.stats or {}).get("n_streamed_blocks") or spec.n_blocks
        forwards = 1 if r.run.offload.cfg_batched else r.plan.workload.cfg_passes
        gaps.append((r.measured.median_step_s - none[_key(r)].measured.median_step_s) / (n * forwards))
    if not gaps:
        notes.append("no offload run with a matching `none` run in the hidden regime: block_overhead_us unchanged")
        return {}
    overhead = max(0.0, statistics.median(gaps) * 1e6)
    _refit_quality(fits, "block_overhead", [(g * 1e6, overhead) for g in gaps], 1,
                   f"{len(gaps)} hidden-regime offload run(s) against their `none` runs, each gap about the median")
    notes.append(f"block_overhead_us {hw.block_overhead_us:.1f} -> {overhead:.1f} from {len(gaps)} hidden-regime "
                 "offload run(s)")
    return {"block_overhead_us": overhead}


def _refit_startup(hw: HardwareSpec, reports: Sequence, notes: list[str], fits: dict[str, Any]) -> dict[str, Any]:
    """startup_s per phase: the first generation of a process less a later one of the same process (generation
    reports run with --warmup), at least 0; for encode also per set of text encoders (`encode:<archs>`), whose
    kernels differ (an LLM's first encode costs more than a T5's). Each gap joins the profile's samples of its key
    (`startup_samples_s`: calibrate's cold processes, earlier refits) and the figure is their mean, its `startup`
    FitQuality the spread of every sample kept about its key's mean (startup.startup_record); keys the reports do
    not measure keep the profile's figure. A report whose process started with its libraries out of the page cache
    (`libraries_cached` under half the profile's warm share: libraries.were_cached) is a freshly started machine's:
    its gaps are `cold:<phase>` samples."""
    from chunkflow.commands.calibrate.startup import startup_record
    from chunkflow.loading.libraries import were_cached
    from chunkflow_planner.catalog import encode_startup_key
    from chunkflow_planner.plan import model_of

    gaps: dict[str, list[float]] = {}
    for r in reports:
        g = r.generation
        if g is None or not g.first_phase_times_s:
            continue
        own = encode_startup_key(model_of(r.plan))
        cold = were_cached(g.libraries_cached, hw.pipeline.libraries_warm_share) is False  # a fresh machine's
        for phase, first in g.first_phase_times_s.items():
            if phase in g.phases:
                gap = max(0.0, first - g.phases[phase].measured_time_s)
                gaps.setdefault(f"cold:{phase}" if cold else phase, []).append(gap)
                if phase == "encode" and own is not None and not cold:
                    gaps.setdefault(own, []).append(gap)
    if not gaps:
        return {}
    n = max(map(len, gaps.values()))
    old = hw.pipeline.startup_samples_s
    how = (f"chunkflow calibrate --from-report {datetime.date.today()}: {n} generation report(s) run with --warmup"
           + (" and the profile's earlier samples" if any(k in old for k in gaps) else ""))
    means, kept, q = startup_record(old, gaps, how)
    if q is not None:
        fits["startup"] = q
    notes.append(f"start-up of a process's first generation from {n} generation report(s) run with --warmup: "
                 + ", ".join(f"{k} {v:.3f} s ({len(kept[k])} sample(s))" for k, v in means.items()))
    return {"startup_s": {**hw.pipeline.startup_s, **means}, "startup_samples_s": {**old, **kept}}


def _refit_quality(fits: dict[str, Any], name: str, pairs: Sequence[tuple[float, float]], fitted: int,
                   how: str) -> None:
    """The FitQuality of a value refit from samples into `fits[name]`: each (sample's estimate, the value written)
    pair gives estimate / value - 1 (a value of 0 gives none), `fitted` the values written (fit.fit_quality); fewer
    than 2 samples, or no more than the values, give no record (the profile's stays, else the prior)."""
    from chunkflow.commands.calibrate.fit import fit_quality

    residuals = [x / v - 1.0 for x, v in pairs if v > 0]
    q = fit_quality(name, residuals, f"chunkflow calibrate --from-report {datetime.date.today()}: {how}",
                    fitted=fitted)
    if q is not None:
        fits[name] = q


def generation_estimate(r, hw: HardwareSpec):
    """The pipeline estimate of a generation report's plan as it ran (its placements, its offload), on `hw`."""
    from chunkflow_planner.plan import model_of
    from chunkflow_planner.pipeline import Placements, estimate
    from chunkflow_planner.policy import Problem

    spec = model_of(r.plan)
    w = r.plan.workload.to_workload().model_copy(update={"steps": r.generation.steps})
    comps = r.plan.pipeline.components
    pl = Placements.of(tuple(c.placement for c in comps if c.kind == "text_encoder"),
                       tuple(c.placement for c in comps if c.kind == "transformer"),
                       next(c.placement for c in comps if c.kind == "vae"), r.plan.pipeline.vae_tiling)
    problem = Problem(spec, w, hw)
    disk = problem.evaluate(r.run.offload.with_overrides(disk_blocks=spec.n_blocks)) if pl.mixed else None
    return estimate(spec, w, hw, pl, problem.evaluate(r.run.offload), disk_point=disk), w


def _refit_pipeline(hw: HardwareSpec, reports: Sequence, notes: list[str]) -> dict[str, Any]:
    """From generation reports (planned whole pipelines), the host-side and allocator terms of the phases:
    - encode_host_s: measured encode less the text encoders' forwards, as measured where the report timed them
      (`parts_s`, after a warm-up), else as predicted (median, at least 0);
    - host_margin: how much longer the timed forwards of text encoders run on the GPU (kept there, or moved there
      for the phase) that were bound by the host took than calibrate timed their layers (text_layer_host_us); one
      ratio per encoder and report, their median (_host_ratios);
    - postprocess_gbps: output bytes over the measured decode less the VAE's predicted decode (median);
    - alloc_slack: (measured peak - context - peak allocated) per predicted activation byte, every phase priced with
      the profile's slack (median); a decode whose VAE fit has its own (VaeDecodeFit.alloc_slack, measured by
      calibrate) refits that one instead (the median of its decodes, plain and tiled apart);
      it replaces the flat reserve over every allocated byte (reserve_fraction set to 0), which fits worse
      (whole pipelines on an H200: median error 0.8% against 2.9%, docs/pipeline-h200.md);
    - mem_margin: the largest under-prediction of a phase's peak left with those terms (rounded up), which plans
      then keep free.
    Each measured phase is compared without its start-up where the report ran a warm-up generation."""
    gens = [r for r in reports if r.generation is not None and r.plan.pipeline is not None]
    if not gens:
        return {}
    base = hw.model_copy(update={"encode_host_s": 0.0, "postprocess_gbps": 1e4, "alloc_slack": 0.0,
                                 "startup_s": {}})
    samples = _PhaseSamples()
    for r in gens:
        samples.add(r, base, hw)
    update = samples.update(hw, notes)
    errors = _peak_errors(hw.model_copy(update=update), gens)
    if errors:  # what the model, refit, still misses: a plan keeps that much of the budget free
        update["mem_margin"] = min(0.5, math.ceil(max(0.0, *errors) * 1000) / 1000)
    notes.append(f"from {len(gens)} generation report(s): " + ", ".join(
        f"{k} {v:.3g}" for k, v in update.items() if k != "vae_decode"))
    notes += [f"VAE {vae}{' (tiled)' if tiled else ''}: its own allocator slack from {len(s)} decode(s), "
              f"{statistics.median(s):.3g}" for (vae, tiled), s in sorted(samples.vae_slack.items())]
    return update


@dataclass
class _PhaseSamples:
    """What each generation report says of the host-side and allocator terms (_refit_pipeline): one sample per
    phase measured, their medians the refit."""

    encode_host: list[float] = field(default_factory=list)
    postprocess: list[float] = field(default_factory=list)
    slack: list[float] = field(default_factory=list)
    vae_slack: dict[tuple[str, bool], list[float]] = field(default_factory=dict)  # (VAE, tiled): decodes priced with
    # their VAE fit's own slack (VaeDecodeFit.alloc_slack), which they refit
    vae_fits: dict[str, Any] = field(default_factory=dict)  # those VAEs' fits as priced (pipeline.decode.vae_fit)
    host_ratios: list[float] = field(default_factory=list)
    cold: int = 0  # reports of a process's first generation with no start-up known to take out
    bound: int = 0  # denoise phases whose activations were priced at a bound (bound_activations): left out

    def add(self, r, base: HardwareSpec, hw: HardwareSpec) -> None:
        """The samples of one generation report `r`, against the estimate with the terms zeroed (`base`)."""
        from chunkflow_planner.plan import model_of
        from chunkflow_planner.pipeline import startup_of

        e, w = generation_estimate(r, base)
        g = r.generation
        spec = model_of(r.plan)
        start = {} if g.warmup_generations else {name: startup_of(spec, name, hw) for name in g.phases}
        unknown = any(start.get(name, 0.0) is None for name in ("encode", "decode"))
        self.cold += unknown
        for name, m in g.phases.items():
            if name == "encode" and g.warmup_generations:
                self.host_ratios += _host_ratios(spec, w, base, g.components, m.parts_s)
            if not (unknown and name in ("encode", "decode")):  # else its time holds the start-up too
                self._add_time(name, m, m.measured_time_s - (start.get(name) or 0.0), e, w, base,
                               warm=bool(g.warmup_generations))
            act = e.phases[name].activation_bytes
            if not peak_judged(r, name):
                self.bound += 1
                continue
            if m.measured_peak_memory_bytes is not None and m.measured_peak_allocated_bytes is not None and act > 0:
                over = max(0.0, (m.measured_peak_memory_bytes - hw.context_bytes - m.measured_peak_allocated_bytes) / act)
                if e.phases[name].alloc_slack is None:
                    self.slack.append(over)
                else:  # priced with its VAE's own slack (calibrate measured it): that one's sample, not the profile's
                    from chunkflow_planner.pipeline.decode import vae_fit

                    self.vae_fits[spec.pipeline.vae.name] = vae_fit(spec, hw)
                    self.vae_slack.setdefault((spec.pipeline.vae.name, bool(r.plan.pipeline.vae_tiling)), []).append(over)

    def _add_time(self, name: str, m, t: float, e, w, base: HardwareSpec, warm: bool) -> None:
        """A phase's measured time `t` (start-up out) as a sample of the encode's host time or the output's rate."""
        from chunkflow_planner.pipeline import output_bytes

        if name == "encode" and warm and m.parts_s and len(m.measured_times_s) == len(next(iter(m.parts_s.values()))):
            self.encode_host.append(max(0.0, statistics.median(  # each generation's time outside its encoders' forwards
                total - sum(p[i] for p in m.parts_s.values()) for i, total in enumerate(m.measured_times_s))))
        elif name == "encode":
            self.encode_host.append(max(0.0, t - e.phases["encode"].time_s))
        elif name == "decode":
            extra = t - e.phases["decode"].time_s + output_bytes(w) / (base.pipeline.postprocess_gbps * 1e9)
            if extra > 0:
                self.postprocess.append(output_bytes(w) / 1e9 / extra)

    def update(self, hw: HardwareSpec, notes: list[str]) -> dict[str, Any]:
        """The profile fields the samples give (their medians); `notes` say which stay unchanged, and why."""
        update: dict[str, Any] = {}
        if self.cold:
            notes.append(f"{self.cold} generation report(s) without --warmup and no start-up in the profile: their "
                         "encode and decode times were not used (they hold the start-up); run with --warmup 1")
        if self.bound:
            notes.append(f"{self.bound} denoise phase(s) of a class never measured (activations priced at a bound) "
                         "left out of alloc_slack, mem_margin and the peak-memory error")
        if self.encode_host:
            update["encode_host_s"] = statistics.median(self.encode_host)
        else:
            notes.append("encode_host_s unchanged: no encode phase to measure it from")
        if self.host_ratios:
            update["host_margin"] = statistics.median(self.host_ratios) * hw.pipeline.host_margin
        if self.postprocess:
            update["postprocess_gbps"] = statistics.median(self.postprocess)
        else:
            notes.append("postprocess_gbps unchanged: no decode longer than the VAE's predicted decode")
        if self.slack:
            update["alloc_slack"] = statistics.median(self.slack)
            update["reserve_fraction"] = 0.0
        if self.vae_slack:
            update["vae_decode"] = self._vae_fits(hw)
        return update

    def _vae_fits(self, hw: HardwareSpec) -> dict:
        """The profile's VAE decode fits, each with its own slack (plain or tiled) refit from the decodes priced with
        it: their median, within the fit's bounds."""
        from chunkflow.commands.calibrate.ops import SLACK_MOST

        fits = dict(hw.pipeline.vae_decode)
        for (vae, tiled), samples in sorted(self.vae_slack.items()):
            fit = fits.get(vae, self.vae_fits[vae])
            slack = min(SLACK_MOST, statistics.median(samples))
            if tiled:
                fits[vae] = fit.model_copy(update={"tiled": fit.tiled.model_copy(update={"alloc_slack": slack})})
            else:
                fits[vae] = fit.model_copy(update={"alloc_slack": slack})
        return fits


def _load_process(r, e, hw: HardwareSpec) -> float | None:
    """A started process's host memory before its first kernels, from a report's load: its host peak less the
    load's other host bytes (eq. L3 on `hw` for the placement `e` as it ran); None without a load."""
    from chunkflow_planner.pipeline.assemble import load_prediction
    from chunkflow_planner.pipeline.load import load_process_bytes
    from chunkflow_planner.plan import model_of

    ld = r.generation.load
    if ld is None or not ld.host_peak_bytes:
        return None
    predicted = load_prediction(model_of(r.plan), e).host_peak_bytes  # (the bytes read do not move the host peak)
    return ld.host_peak_bytes - (predicted - load_process_bytes(hw))


def refit_load(hw: HardwareSpec, reports: Sequence, notes: list[str] | None = None) -> dict[str, Any]:
    """From generation reports, the host memory a process holds besides its components (`process_host_bytes`:
    the measured host peak less the plan's other host bytes, recomputed on `hw`; median), the same before its first
    kernels (`process_start_host_bytes`: the load's host peak less the load's other bytes, _load_process; median)
    and the load's start-up (`load_startup_s`: a load from a folder less its predicted reads, copies and
    page-locking for the bytes it read and the share the page cache held, eq. L1; median, at least 0; needs the
    profile's disk rate)."""
    from chunkflow_planner.pipeline.load import LoadEstimate, T_load

    notes = [] if notes is None else notes
    gens = [r for r in reports if r.generation is not None and r.plan.pipeline is not None]
    process, start, startup = [], [], []
    zero = hw.model_copy(update={"load_startup_s": 0.0})
    for r in gens:
        e, _ = generation_estimate(r, hw)
        others = sum(v for k, v in e.host_bytes.items() if k != "process")
        process.append(r.generation.host_peak_bytes - others)
        start += [x for x in [_load_process(r, e, hw)] if x is not None]
        ld, lp = r.generation.load, r.plan.prediction.load
        if ld is not None and lp is not None and ld.read_bytes > 0:
            est = LoadEstimate(ld.read_bytes, lp.h2d_bytes, lp.pinned_bytes, lp.host_peak_bytes, lp.fresh_bytes,
                               lp.pinned_while_reading_bytes)
            rest = T_load(est, ld.cached_fraction or 0.0, zero)
            if rest is not None:
                startup.append(max(0.0, ld.measured_time_s - rest))
    update: dict[str, Any] = {}
    if process and statistics.median(process) > 0:
        update["process_host_bytes"] = int(statistics.median(process))
    if start and statistics.median(start) > 0:
        update["process_start_host_bytes"] = int(statistics.median(start))
    if startup:
        update["load_startup_s"] = statistics.median(startup)
    elif gens:
        notes.append("load_startup_s unchanged: no load from a folder with a disk rate in the profile")
    if update:
        notes.append(f"from {len(gens)} generation report(s): " + ", ".join(
            f"{k} {v:.4g}" for k, v in update.items()))
    return update


HOST_BOUND = 1.5  # a timed forward this many times its predicted device time is the host's


def _host_ratios(spec: ModelSpec, w, hw: HardwareSpec, placements: dict[str, str],
                 parts: dict[str, list[float]]) -> list[float]:
    """Timed forward / predicted host dispatch (pipeline.text_host_s on `hw`) of each text encoder run on the GPU
    (`gpu`, or `phase` where the report timed its move apart) whose timed forwards (the median over the report's
    generations) took HOST_BOUND x its predicted device time or more and whose architecture calibrate timed: one
    value per encoder and report, so that no report weighs more for having measured more generations."""
    from chunkflow_planner.pipeline import text_device_s, text_host_s

    out = []
    for te in spec.pipeline.text_encoders:
        on_gpu = placements.get(te.component) == "gpu" or (
            placements.get(te.component) == "phase" and f"{te.component} to device" in parts)
        host = text_host_s(te, hw)
        if not on_gpu or not parts.get(te.component) or host <= 0:
            continue
        t = statistics.median(parts[te.component]) / w.cfg_passes
        if t >= HOST_BOUND * text_device_s(te, hw):
            out.append(t / host)
    return out


def bound_activations(r) -> bool:
    """Whether the report's plan priced its transformer's activations at a bound (a class never measured: the
    default model x derive.ACTIVATION_MARGIN, `ActivationModel.prior_multiple`): its denoise peak says how far under
    the bound the class lands (PixArt-Sigma: 0.44 of it), not the memory model's or the allocator's error, so the
    refit leaves that phase out of alloc_slack, mem_margin and the peak-memory error."""
    from chunkflow_planner.plan import model_of

    return model_of(r.plan).activation.prior_multiple is not None


def peak_judged(r, name: str) -> bool:
    """Whether phase `name`'s peak in report `r` measures the memory model's and the allocator's error: all but a
    denoise whose activations were priced at a bound (bound_activations)."""
    return not (name == "denoise" and bound_activations(r))


def _peak_errors(hw: HardwareSpec, gens: Sequence) -> list[float]:
    """measured / predicted - 1 of every phase's peak GPU memory in generation reports, predicted on `hw`."""
    errors = []
    for r in gens:
        e, _ = generation_estimate(r, hw)
        for name, m in r.generation.phases.items():
            if m.measured_peak_memory_bytes and e.peak_memory(name) > 0 and peak_judged(r, name):
                errors.append(m.measured_peak_memory_bytes / e.peak_memory(name) - 1)
    return errors


def report_errors(r, hw: HardwareSpec | None = None, refit_hw: HardwareSpec | None = None) -> dict[str, list[float]]:
    """measured / predicted - 1 of one run report by bands.QUANTITY_KINDS, the errors the report computed itself:
    step_time (the median step against the plan's), peak_memory (the steps' peak allocated of the transformer run alone,
    each phase's peak of a generation),
    and from a generation report generation_time, phase_time (each phase), host_memory (the generation's host peak
    and the load's) and load_time. With `hw` (the profile the report's plan was priced on) and `refit_hw`, the step
    is compared with refit_hw's prediction instead, where predicting the run on `hw` gives back the report's own
    prediction (the same model, so the refit's re-prediction is what a new plan would say)."""
    out: dict[str, list[float]] = {}

    def add(kind: str, e: float | None) -> None:
        if e is not None and math.isfinite(e):
            out.setdefault(kind, []).append(e)

    step = r.rel_error.step_time
    if step is not None and hw is not None and refit_hw is not None:
        from chunkflow_planner.plan import model_of

        spec, w = model_of(r.plan), r.plan.workload.to_workload()
        before = predict(spec, w, hw, r.run.offload, r.run.sp_degree).step_time_s
        if math.isclose(before, r.predicted.step_time_s, rel_tol=1e-6):
            step = r.measured.median_step_s / predict(spec, w, refit_hw, r.run.offload, r.run.sp_degree).step_time_s - 1
    add("step_time", step)
    g = r.generation
    if g is None:  # a generation's step peak held the whole pipeline's tensors (older reports kept its error)
        add("peak_memory", r.rel_error.peak_memory)
    else:
        add("generation_time", g.generation_time_error)
        add("host_memory", g.host_memory_error)
        for name, m in g.phases.items():
            add("phase_time", m.time_error)
            if peak_judged(r, name):
                add("peak_memory", m.memory_error)
        if g.load is not None:
            add("load_time", g.load.time_error)
            add("host_memory", g.load.host_error)
    return out


MAX_ERRORS = 256  # errors a ModelError keeps (the newest)


def model_errors(reports: Sequence, hw: HardwareSpec | None = None, refit_hw: HardwareSpec | None = None
                 ) -> dict[str, Any]:
    """The planner's error by kind of prediction (ModelError by bands.QUANTITY_KINDS) over run reports
    (report_errors), each kind's errors kept (model_error).

    These are the errors of the plans as they were made, on the profile before this refit (the step, where the
    refit re-predicts it, against the refit profile: report_errors): the refit corrects some of the terms they came
    from, so for the other kinds the band they give is conservative."""
    errors: dict[str, list[float]] = {}
    counts: dict[str, int] = {}
    for r in reports:
        for kind, es in report_errors(r, hw, refit_hw).items():
            errors.setdefault(kind, []).extend(es)
            counts[kind] = counts.get(kind, 0) + 1
    return {kind: model_error(kind, es, counts[kind]) for kind, es in errors.items()}


def model_error(kind: str, errors: Sequence[float], reports: int, earlier: int = 0):
    """The ModelError of `kind` from its errors (measured / predicted - 1; the newest MAX_ERRORS kept, and the
    bias and spread are theirs) out of `reports` run reports: bias = their median, spread = 1.4826 x their median
    absolute deviation about it. From fewer than 2 reports the spread is at least the kind's prior scatter
    (bands.MODEL_PRIOR / bands.Z): one report measures a bias, but its errors (a generation's phases) scatter among
    themselves, not from run to run. `earlier`: how many of the errors a previous refit kept (the source says so)."""
    from chunkflow_planner.bands import MODEL_PRIOR, Z
    from chunkflow_planner.catalog import ModelError

    es = [float(e) for e in errors][-MAX_ERRORS:]
    bias = statistics.median(es)
    spread = 1.4826 * statistics.median(abs(e - bias) for e in es)
    if reports < 2:
        spread = max(spread, MODEL_PRIOR[kind] / Z)
    source = f"{len(es)} error(s) in {reports} run report(s)"
    if earlier:
        source += f", {min(earlier, len(es))} of them kept from an earlier refit"
    if reports < 2:
        source += "; one report: at least the prior's spread"
    return ModelError(samples=len(es), reports=reports, bias=max(-10.0, min(10.0, bias)), spread=min(10.0, spread),
                      errors=es, source=source)


def merge_model_errors(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """`new` ModelErrors (model_errors) merged with a profile's `old` ones: a kind the profile has with its errors
    kept gets those followed by the new (the newest MAX_ERRORS), its bias and spread over all of them and the
    reports summed (model_error); one kept without errors (a profile written before they were) is replaced."""
    out = {}
    for kind, e in new.items():
        prev = old.get(kind)
        out[kind] = e if prev is None or not prev.errors else model_error(
            kind, [*prev.errors, *e.errors], prev.reports + e.reports, earlier=len(prev.errors))
    return out


def refit(hw: HardwareSpec, reports: Sequence) -> tuple[HardwareSpec, list[str]]:
    """Adjust `hw` to measured runs; returns the new profile and one note per adjustment.

    - eta_comp: each `none` report gives k = predicted compute / measured compute (measured step minus the
      predicted non-compute part), with predictions recomputed on `hw`; the curve and scalar are scaled by the
      geometric mean of k (capped at 1).
    - block_overhead_us: each offload report with a `none` report of the same workload, predicted `hidden`,
      gives (measured offload - measured none) / (streamed blocks * forwards per step); the median, at least 0.
    - startup_s: generation reports run with --warmup give, per phase, the first generation's time less the
      measured one's; the median, at least 0.
    - fits: block_overhead and startup where 2 samples or more give them (each sample about the value written,
      _refit_quality); fewer keep the profile's record, else the prior.
    - encode_host_s, postprocess_gbps, alloc_slack, mem_margin: from generation reports (_refit_pipeline).
    - process_host_bytes, process_start_host_bytes, load_startup_s: from generation reports and their loads
      (refit_load).
    - model_errors: the planner's errors in the reports by kind of prediction (model_errors), added to those the
      profile keeps of the same kind (merge_model_errors); kinds the reports do not measure keep the profile's.
    """
    notes: list[str] = []
    fits: dict[str, Any] = {}
    none = {_key(r): r for r in reports if r.run.offload.mode == "none"}
    update = {**_refit_eta(hw, none, notes), **_refit_overhead(hw, reports, none, notes, fits),
              **_refit_startup(hw, reports, notes, fits)}
    if fits:
        update["fits"] = {**hw.fits, **fits}
    update.update(_refit_pipeline(hw.model_copy(update=update), reports, notes))
    update.update(refit_load(hw.model_copy(update=update), reports, notes))
    old = hw
    if update:
        update["source"] = (hw.source + f"; refit from {len(reports)} run report(s) {datetime.date.today()}").lstrip("; ")
        try:
            hw = HardwareSpec(**{**hw.model_dump(), **update})
        except ValidationError as e:
            err = e.errors()[0]
            raise CalibrationError(f"the refit gives {'.'.join(map(str, err['loc']))} outside its range "
                                   f"({err['msg']}); these runs do not fit profile {hw.name!r}") from None
    errors = merge_model_errors(hw.model_errors, model_errors(reports, old, hw))
    if errors:
        hw = HardwareSpec(**{**hw.model_dump(), "model_errors": {**hw.model_errors, **errors}})
        notes.append("the planner's errors in these reports: " + ", ".join(
            f"{k} {e.bias:+.1%} +-{e.spread:.1%} ({e.samples} in {e.reports} report(s))" for k, e in errors.items()))
    return hw, notes
