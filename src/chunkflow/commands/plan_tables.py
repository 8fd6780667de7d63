"""Human-readable output: the plan tables that `chunkflow plan` prints."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from chunkflow_planner.plan import Plan
from chunkflow_planner.explain import MarginKept
from chunkflow_planner.units import format_bytes, format_rate, format_seconds, format_seconds_apart


def _sci(x: float) -> str:
    return f"{x:.3e}"


def band_text(plan: Plan, key: str) -> str:
    """" +-6%": the band of the plan's prediction `key` (its path in `prediction`, bands.py), or "" without one."""
    b = plan.prediction.bands.get(key)
    if b is None:
        return ""
    below, above = b.edges()
    if abs(below - above) > 1e-9:  # a first generation's time: its start-up only adds
        return f" +{_band_pct(above)}/-{_band_pct(below)}"
    return f" +-{_band_pct(b.rel)}"


def _band_pct(share: float) -> str:
    """A band's share as a percentage: whole above 9.5%, else one decimal ("6%", "6.4%")."""
    pct = share * 100
    return f"{pct:.0f}%" if pct >= 9.5 else f"{pct:.1f}%".replace(".0%", "%")


def _verdict_band(v) -> str:  # noqa: ANN001 - chunkflow.reports.BandVerdict
    """A verdict's band: "+-7.2%", or "+45.0%/-8.1%" where it is asymmetric."""
    if v.below is not None and v.above is not None and abs(v.below - v.above) > 1e-9:
        return f"+{v.above:.1%}/-{v.below:.1%}"
    return f"+-{v.band:.1%}"


CACHE_RECORDED_BY = {"cache hit rate": "run --cache ... --report R.json, then plan --cache-hit-rate R.json"}


def bands_note(plan: Plan) -> str | None:
    """What the plan's bands are made of, and how to narrow them; None for a plan without bands."""
    from chunkflow_planner.bands import FITS

    bands = plan.prediction.bands
    if not bands:
        return None
    reported = sorted({b.model.split(" from run reports")[0] for b in bands.values() if "from run reports" in b.model})
    text = ("bands (+-): about 95% of a run's measurements on this machine, from the spreads of the profile's fits "
            "and the planner's own error (" + (f"from run reports for {', '.join(reported)}" if reported else
                                               "a prior: no run reports refit this profile") + ")")
    supposed = {f for b in bands.values() for f in b.supposed}
    if supposed:
        by: dict[str | None, list[str]] = {}
        for f in sorted(supposed):
            by.setdefault(FITS[f].recorded_by if f in FITS else CACHE_RECORDED_BY.get(f), []).append(f)
        said = [f"{', '.join(fs)} (`{cmd}` records them)" for cmd, fs in by.items() if cmd is not None]
        if None in by:
            said.append(f"{', '.join(by[None])} (measured once or not at all: a prior always)")
        text += "; prior spreads stood in for " + "; ".join(said)
    if not reported:
        text += "; `chunkflow calibrate --from-report REPORT` measures the planner's own error from your runs"
    fits = {n: f for n, f in ((plan.hardware.spec or {}).get("fits") or {}).items() if isinstance(f, dict)}
    once = sorted(n for n, f in fits.items() if f.get("drift") is None and n in FITS and FITS[n].drift_prior)
    if once:
        text += (f"; the drift between runs of {', '.join(once)} is a prior (calibrating again, saved over the "
                 "default profile, measures it)")
    flagged = {n: f for n, f in fits.items() if f.get("flagged")}
    if flagged:
        text += ("; calibrate flagged as too wide to plan with: " + "; ".join(
            f"{n} (+-{f.get('spread', 0):.0%} a sample; measure again: {f.get('repeat') or 'calibrate'})"
            for n, f in flagged.items()))
    return text


def format_said(plan: Plan) -> str | None:
    """The plan's stored format in one line: its bytes against bf16's, a step's host-to-device bytes, the decode
    and its rate (measured or supposed); None in the model's own dtype."""
    f = plan.format
    if f is None:
        return None
    rates = ", ".join(f"{n} {r:.0f} GB/s" for n, r in f.decode_gbps.items())
    moved = (f"{format_bytes(f.h2d_bytes_per_step)} host-to-device a step against {format_bytes(f.h2d_bytes_per_step_bf16)} "
             "in bf16" if f.h2d_bytes_per_step_bf16 else "nothing streamed")
    where = ("in each block's forward" if plan.offload.decode != "ahead" or not plan.offload.streams else
             "a streamed block's ahead of its forward, on the copy stream (two decode buffers)")
    return (f"format: {f.name} ({f.source}): the blocks {f.block_bytes_ratio:.2f}x of bf16's bytes, the transformer "
            f"{format_bytes(f.stored_bytes)} against {format_bytes(f.bf16_bytes)}; {moved}; dequantized on the GPU "
            f"{where}, {format_seconds(f.decode_s_per_step)} a step at {rates} "
            + ("(measured)" if f.decode_measured else "(supposed: `chunkflow calibrate` measures it)"))


def cache_said(plan: Plan) -> str | None:
    """The step cache in one line: the steps it computes and skips, and the steps' time with and without it; None
    without a cache."""
    c, w = plan.prediction.cache, plan.workload
    if c is None:
        return None
    from chunkflow_planner.stepcache import runs_when_skipped

    runs = runs_when_skipped(w.cache.setting) if w.cache is not None else "none"
    skipped = {"first": "the first block only", "all": "every block (only attention is predicted, so every block "
               "still streams: taylorseer:...,lite skips the blocks)"}.get(runs, "no block")
    if c.hit_rate is None:
        rate = "a schedule known ahead"
    else:
        spread = w.cache.hit_rate_spread if w.cache is not None else 0.0
        rate = f"hit rate {c.hit_rate:.0%}" + (f" +-{spread:.0%}" if spread else "") + {
            "given": " (given)", "reports": " (run reports' measured share)",
            "prior": " (a prior: nothing measured it; --cache-hit-rate from a run's report)",
        }.get(c.hit_rate_source, f" ({c.hit_rate_source})")
    lo, hi = c.computed_steps_range
    ends = f" ({lo}-{hi} at the spread)" if lo != hi else ""
    return (f"cache: {c.label}, {rate}: {c.computed_steps} of {w.steps} steps computed{ends}, the other "
            f"{c.skipped_steps} run {skipped}; the steps take {format_seconds(c.steps_s)} against "
            f"{format_seconds(c.uncached_steps_s)} uncached ({c.speedup:.2f}x; the cache's output is not the "
            "uncached one's)")


def print_plan(console: Console, plan: Plan, decision, analysis) -> None:  # noqa: ANN001 - planner types
    """The answer first (the chosen plan, why, the pipeline's phases and memory), then how it was reached: the
    overlap analysis and each mode's prediction."""
    w, hw = plan.workload, plan.hardware
    shape = f"{w.width}x{w.height}, " + (f"{w.frames} frames" if w.frames > 1 else f"batch {w.batch}")
    console.print(
        f"[bold]{plan.model.name}[/] at {shape} ({w.tokens} tokens/sample), SP={plan.parallel.sp_degree}, "
        f"{w.steps} steps x {w.cfg_passes} pass(es)",
        highlight=False,
    )
    console.print(escape(f"hardware: {hw.name} [{hw.source}]"), highlight=False)
    said = format_said(plan)
    if said:
        console.print(said, markup=False, highlight=False)
    if hw.device_is_host:
        console.print("note: a plan for the CPU (chunkflow's CPU mode, the same runtime with synchronous copies): "
                      "its times are nominal figures, not predictions; its memory is host memory, and that is "
                      "planned for", highlight=False)
    cache = plan.prediction.cache
    total = cache.steps_s if cache is not None else plan.prediction.step_time_s * w.steps
    target, step = format_seconds_apart(plan.target_step_time_s or 0, plan.prediction.step_time_s)
    console.print(f"[bold green]plan:[/] {_chosen_text(plan)}; {hw.device_word} budget {_budget_text(plan)}; target "
                  f"{target} per step, {step}{band_text(plan, 'step_time_s')} predicted; {w.steps} steps take about "
                  f"{format_seconds(total)}", highlight=False)
    console.print(f"[bold]why:[/] {escape(plan.reason)}", highlight=False)
    said = cache_said(plan)
    if said:
        console.print(said, markup=False, highlight=False)
    if plan.pipeline is not None:
        print_pipeline(console, plan)
    else:
        print_host_alone(console, plan)
    # the answer first (issue 53), then how it was reached: the paper's overlap analysis and every mode priced
    console.print("[bold]how:[/] the overlap analysis (ChunkFlow eqs. 5, 6) and each mode at this workload",
                  highlight=False)
    console.print(_analysis_table(plan))
    console.print(_modes_table(plan))
    tie = tie_note(plan)
    if tie:
        console.print(tie, highlight=False)


def _analysis_table(plan: Plan) -> Table:
    """The overlap analysis of paper section 3.1 at the plan's workload and setting."""
    a = plan.analysis
    levers = [x for x, on in (("both guidance passes in one forward", plan.offload.cfg_batched),
                              ("fp8 weights", plan.offload.weight_dtype != "bf16"),
                              (f"codec {plan.offload.codec}", plan.offload.codec != "none")) if on]
    t = Table(title=f"Overlap analysis (per {plan.hardware.device_word}, per block; paper section 3.1)"
              + (f"\nof the plan's setting: {', '.join(levers)}" if levers else ""))
    t.add_column("quantity")
    t.add_column("value", justify="right")
    t.add_column("meaning")
    t.add_row("F_block", _sci(a.block_flops_per_gpu) + " FLOP", "block compute (eq. 23 / SP)")
    t.add_row("B_pref", format_bytes(a.prefetch_bytes_per_block), "bytes prefetched per block")
    t.add_row("F*", _sci(a.f_star) + " FLOP", "critical workload (eq. 4)")
    t.add_row("T_comp / T_pref", f"{format_seconds(a.t_comp_s)} / {format_seconds(a.t_pref_s)}", "eqs. 1 and 2")
    t.add_row("I_block / I*", f"{a.i_block:.0f} / {a.i_star:.0f}", "FLOP per prefetched byte (eqs. 5, 6)")
    t.add_row("regime", a.regime, "hidden: F_block >= F*")
    crit = a.critical
    crit_text = f"{crit.value:.1f} {crit.axis} (nearest valid {crit.nearest_valid})" if crit.value is not None else crit.reason
    t.add_row(f"critical {crit.axis}", crit_text, "where F_block reaches F*")
    return t


def _modes_table(plan: Plan) -> Table:
    """Step time and peak memory of no offload, layerwise streaming and the chosen setting."""
    host = plan.hardware.device_is_host  # nothing is page-locked on the CPU: the streamed weights are a host store
    m = Table(title=f"Predicted step time and peak {plan.hardware.device_word} memory")
    for col in ("mode", "chunk", "residency", "step time", "vs none", "peak memory", "host store" if host else "pinned host"):
        m.add_column(col, justify="right" if col not in ("mode",) else "left")
    base = plan.prediction.baselines.none.step_time_s
    bl = plan.prediction.baselines
    rows = [("none" + (" cfg-batched" if bl.none_cfg_batched else ""), None, None, bl.none),
            ("layerwise", None, 0.0, bl.layerwise)]
    o = plan.offload
    rows.append((o.mode + o.levers_label + " (chosen)", o.chunk_bytes if o.mode == "chunkflow" else None,
                 o.residency if o.mode != "none" else None, plan.prediction))
    for name, chunk, res, p in rows:
        chosen = p is plan.prediction  # the bands are the chosen setting's
        band = (lambda key: band_text(plan, key)) if chosen else (lambda key: "")
        m.add_row(
            name,
            ("whole block" if chunk >= plan.analysis.prefetch_bytes_per_block else format_bytes(chunk)) if chunk
            else "-",
            f"{res:.0%}" if res is not None else "-",
            format_seconds(p.step_time_s) + band("step_time_s"),
            f"{p.step_time_s / base:.3f}x",
            format_bytes(p.peak_memory_bytes) + band("peak_memory_bytes"),
            format_bytes(p.pinned_host_bytes) + band("pinned_host_bytes") if p.pinned_host_bytes else "-",
        )
    return m


def _chosen_text(plan: Plan) -> str:
    """The chosen setting in words: mode, chunk and residency, and the levers that apply."""
    o, hw = plan.offload, plan.hardware
    chosen = f"mode {o.mode}" + (f", chunk {format_bytes(o.chunk_bytes)}{_chunk_cap(plan)}, residency {o.residency:.0%}"
                                 if o.mode == "chunkflow" else "")
    if o.whole_blocks:
        chosen += f" ({'block' if len(o.whole_blocks) == 1 else 'blocks'} {', '.join(map(str, o.whole_blocks))} whole)"
    if plan.workload.cfg_passes > 1:
        chosen += ", guidance passes " + ("batched (one forward a step)" if o.cfg_batched else "unbatched")
    if o.mode != "none" and plan.format is not None:
        chosen += f", weights streamed as the {plan.format.name} file stores them"
    elif o.mode != "none":
        chosen += f", weights stored {o.weight_dtype}" + (
            " (cast on the copy stream)" if o.weight_dtype != "bf16" and o.fp8_cast == "copy" else "")
    if o.mode == "chunkflow" and plan.parallel.sp_degree > 1:
        chosen += ", copies " + ("paced around collectives" if o.comm_aware else f"not paced ({hw.peer_link} peer link)")
    if o.mode != "none":
        chosen += ", " + codec_text(plan)
    return chosen


def codec_text(plan: Plan) -> str:
    """The codec of the plan in words: raw, or its name, ratio (measured or supposed) and the bytes it saves."""
    o, pp = plan.offload, plan.prediction
    if o.codec == "none":
        return "streamed bytes raw (no codec)"
    ratio = (f"ratio {pp.codec_ratio:.3f} ({'measured' if pp.codec_ratio_measured else 'supposed'})"
             if pp.codec_ratio is not None else "ratio unknown")
    return (f"codec {o.codec} ({ratio}, decoded at {pp.codec_decode_gbps or 0:g} GB/s): "
            f"{format_bytes(pp.codec_saved_bytes_per_step)} fewer host-to-device bytes a step, "
            f"{format_bytes(pp.codec_saved_host_bytes)} less host memory"
            + (f", a {format_bytes(pp.codec_spill_bytes)} spill file for the disk tier's blocks"
               if pp.codec_spill_bytes else ""))


def _chunk_cap(plan: Plan) -> str:
    """What a chunk larger than a block means (empty where a block is several chunks): a copy never crosses a
    block, so each block is one chunk and the budget holds the block, not the chunk size."""
    block = plan.analysis.prefetch_bytes_per_block
    if plan.offload.chunk_bytes < block:
        return ""
    return f" (capped at the block: each block's {format_bytes(block)} streamed is one chunk)"


def _budget_text(plan: Plan) -> str:
    """The GPU budget, and what of it the plan used after the memory model's margin."""
    budget = format_bytes(plan.memory_budget_bytes) if plan.memory_budget_bytes else "-"
    if plan.memory_budget_bytes and plan.memory_margin:
        usable = MarginKept(plan.memory_budget_bytes, plan.memory_margin).usable
        budget += (f" (planned inside {format_bytes(usable)}: "
                   f"{plan.memory_margin:.1%} kept for the memory model's error)")
    return budget


def tie_note(plan: Plan) -> str | None:
    """What chunkflow buys where the plan predicts layerwise streaming as fast and as small (None elsewhere)."""
    o, lw, a = plan.offload, plan.prediction.baselines.layerwise, plan.analysis
    p = plan.prediction
    if o.mode != "chunkflow" or lw.step_time_s <= 0:
        return None
    if abs(p.step_time_s - lw.step_time_s) > 0.005 * lw.step_time_s or p.peak_memory_bytes > 1.01 * lw.peak_memory_bytes:
        return None
    crit = a.critical
    below = (f"below the critical {crit.axis} (about {crit.value:.0f} here)" if crit.value is not None
             else "below the critical workload")
    why = ("every block's copy hides behind its compute at this workload, so streaming whole layers costs no more"
           if a.regime == "hidden" else "the plan's levers hide the copies as well either way")
    return (f"note: layerwise streaming ties with chunkflow here ({why}). chunkflow is what holds the time "
            f"{below}, where it keeps part of each block on the GPU chunk by chunk, and under sequence "
            "parallelism, where its copies pause around the collectives.")


def print_host_alone(console: Console, plan: Plan) -> None:
    """The transformer alone against a host budget, and its disk tier (nothing without --host-mem-budget)."""
    pp = plan.prediction
    note = bands_note(plan)
    if note:
        console.print(note, highlight=False, markup=False)
    if plan.host_memory_budget_bytes is None:
        return
    console.print(f"host memory: {format_bytes(pp.host_memory_bytes or 0)}{band_text(plan, 'host_memory_bytes')} "
                  "(the pinned store and the process) of "
                  f"{format_bytes(plan.host_memory_budget_bytes)} (--host-mem-budget"
                  + (f", planned inside {format_bytes(int(plan.host_memory_budget_bytes / (1 + plan.host_memory_margin)))}"
                     f": {plan.host_memory_margin:.1%} kept for the host model's error" if plan.host_memory_margin
                     else "") + ")", highlight=False)
    if plan.offload.disk_blocks:
        console.print(disk_blocks_line(plan), highlight=False)


def disk_blocks_line(plan: Plan) -> str:
    """The transformer's disk blocks: how many, the bytes a step reads and whether they hide."""
    pp = plan.prediction
    where = ("the checkpoint's files" if not pp.codec_spill_bytes else
             f"the codec's spill file, encoded ({format_bytes(pp.codec_spill_bytes)} written at the load to "
             "CHUNKFLOW_CACHE_DIR or ~/.cache/chunkflow, deleted when the process ends)")
    return (f"disk: {plan.offload.disk_blocks} of {plan.model.n_blocks} blocks keep their streamed bytes in "
            f"{where}, {format_bytes(pp.disk_read_bytes_per_step)} read a step at {pp.disk_read_gbps:.2f} GB/s"
            + (f", {format_seconds(pp.disk_stall_s)} of the step waiting for them" if pp.disk_stall_s
               else ", hidden behind the step") + " (run it with --weights: the files are read "
            + ("once at the load" if pp.codec_spill_bytes else "each step") + ")")


def expert_offload(plan: Plan, placement: str):  # noqa: ANN201 - offload.OffloadConfig
    """The offload a transformer placed `placement` runs: the plan's, with every block on disk where it is on disk
    beside a streamed expert (the runtime's `disk` placement)."""
    on_disk = placement == "disk" and any(c.kind == "transformer" and c.placement == "stream"
                                          for c in plan.pipeline.components)
    return plan.offload.with_overrides(disk_blocks=plan.model.n_blocks) if on_disk else plan.offload


def print_pipeline(console: Console, plan: Plan) -> None:
    """Where each component runs, each phase's time and peak GPU memory, host memory against its budget."""
    pp = plan.prediction
    console.print(_components_table(plan))
    console.print(_phases_table(plan))
    startup = sum(getattr(pp.phases, n).startup_s for n in ("encode", "denoise", "decode"))
    if startup > 0:
        console.print(f"times are a process's first generation: {format_seconds(startup)} of it is one-time start-up "
                      "(a later generation in the same process is that much faster)", highlight=False)
    _print_pipeline_host_memory(console, plan)
    if pp.disk_read_bytes_per_generation:
        rate = plan.hardware.spec.get("disk_read_gbps") if plan.hardware.spec else None
        console.print(f"disk reads: {format_bytes(pp.disk_read_bytes_per_generation)} a generation from the "
                      "checkpoint's files" + (f" at {rate:.2f} GB/s" if rate else "")
                      + " (run it with --weights: they are read from there)", highlight=False)
    if plan.offload.disk_blocks and any(c.kind == "transformer" and c.placement in ("stream", "disk")
                                        for c in plan.pipeline.components):
        console.print(disk_blocks_line(plan), highlight=False)
    if pp.load is not None:
        console.print(plan_load_line(pp.load, plan.hardware.device_is_host, plan), highlight=False)
    note = bands_note(plan)
    if note:
        console.print(note, highlight=False, markup=False)


def _placement_words(plan: Plan) -> dict[str, str]:
    """What each placement of a pipeline component means, on a GPU or on the CPU device."""
    on_disk = {"disk": "on disk: read from the checkpoint's files at its phase, no host copy"}
    if plan.hardware.device_is_host:
        return {"gpu": "on the device (the CPU) throughout", "phase": "on the device (the CPU) for its phase only",
                "stream": "streamed by chunkflow from host memory", "cpu": "runs on the CPU", **on_disk}
    return {"gpu": "on the GPU throughout", "phase": "on the GPU for its phase only (pinned host copy)",
            "stream": "streamed by chunkflow from pinned host memory", "cpu": "runs on the CPU", **on_disk}


def _components_table(plan: Plan) -> Table:
    """The pipeline's components: kind, weights, where each runs (and its disk reads, where any has them)."""
    c = Table(title="Components (the whole pipeline)")
    disk = any(comp.disk_read_bytes for comp in plan.pipeline.components)
    for col in ("component", "kind", "weights", "placement") + (("disk reads",) if disk else ()):
        c.add_column(col, justify="right" if col in ("weights", "disk reads") else "left")
    what = _placement_words(plan)
    for comp in plan.pipeline.components:
        where = what[comp.placement]
        if comp.kind == "transformer" and comp.placement in ("stream", "disk"):
            where += f" ({expert_offload(plan, comp.placement).label})"
        if comp.steps is not None:
            where += f"; {comp.steps} of {plan.workload.steps} steps"
        if comp.kind == "vae" and plan.pipeline.vae_tiling:
            where += ", tiled decode"
        reads = (format_bytes(comp.disk_read_bytes) if comp.disk_read_bytes else "-",) if disk else ()
        c.add_row(comp.name, comp.kind.replace("_", " "), format_bytes(comp.bytes), where, *reads)
    return c


def _phases_table(plan: Plan) -> Table:
    """Each phase's predicted time and peak device memory, then the whole generation's time."""
    pp = plan.prediction
    dev = plan.hardware.device_word
    t = Table(title="Predicted generation, phase by phase " + (
        "(peak device memory: the allocation, which on the CPU is host memory)" if plan.hardware.device_is_host else
        "(peak GPU memory = allocation + what the allocator holds beyond it + CUDA context)"))
    for col in ("phase", "time", f"peak {dev} memory"):
        t.add_column(col, justify="left" if col == "phase" else "right")
    for name in ("encode", "denoise", "decode"):
        ph = getattr(pp.phases, name)
        t.add_row(name, format_seconds(ph.time_s) + band_text(plan, f"phases.{name}.time_s"),
                  format_bytes(ph.peak_memory_bytes) + band_text(plan, f"phases.{name}.peak_memory_bytes"))
    t.add_row("[bold]generation[/]", format_seconds(pp.generation_time_s or 0) + band_text(plan, "generation_time_s"),
              "")
    return t


def _print_pipeline_host_memory(console: Console, plan: Plan) -> None:
    """The host memory the pipeline needs (its split between the ranks under SP), against its budget where one is
    held."""
    pp = plan.prediction
    host = ", ".join(f"{k} {format_bytes(v)}" for k, v in (pp.host_memory or {}).items() if v)
    split = host_split_text(plan)
    if split:
        console.print(f"host memory {split}", highlight=False)
        host = f"a rank: {host}"
    where = plan.host_memory_budget_source or "budget"
    hband = band_text(plan, "host_memory_bytes")
    if plan.host_memory_budget_bytes is None:
        console.print(f"host memory: {format_bytes(pp.host_memory_bytes or 0)}{hband} needed ({host}); {where}",
                      highlight=False)
        return
    hint = "; --host-mem-budget plans for another machine" if where != "--host-mem-budget" else ""
    kept = (f", planned inside {format_bytes(int(plan.host_memory_budget_bytes / (1 + plan.host_memory_margin)))}: "
            f"{plan.host_memory_margin:.1%} kept for the host model's error" if plan.host_memory_margin else "")
    console.print(f"host memory: {format_bytes(pp.host_memory_bytes or 0)}{hband} ({host}) of "
                  f"{format_bytes(plan.host_memory_budget_bytes)} ({where}{hint}{kept})", highlight=False)

def host_split_text(plan: Plan) -> str | None:
    """Under SP, the host's memory and its split (pipeline/hostshare.py): "82.5 GB per host: 29.0 GB shared once +
    2 x 26.7 GB per rank"; None with one rank."""
    pp, n = plan.prediction, plan.parallel.sp_degree
    if n <= 1 or pp.host_memory_per_rank_bytes is None or pp.host_memory_bytes is None:
        return None
    text = f"{format_bytes(pp.host_memory_bytes)} per host: "
    if pp.host_memory_shared_bytes:
        text += f"{format_bytes(pp.host_memory_shared_bytes)} shared once + "
    text += f"{n} x {format_bytes(pp.host_memory_per_rank_bytes)} per rank"
    if not plan.offload.share_host:
        text += " (--no-share-host: each rank pins its own copy)"
    return text


def plan_load_line(ld, device_is_host: bool = False, plan: Plan | None = None) -> str:  # noqa: ANN001 - plan.LoadPrediction
    """The plan's load: time from cold files and from the page cache, and the host memory it holds (with their bands
    where `plan` is given)."""
    band = (lambda key: band_text(plan, key)) if plan is not None else (lambda key: "")
    if device_is_host:
        return (f"load: {format_bytes(ld.read_bytes)} read ({ld.read_bytes_source}); host memory "
                f"{format_bytes(ld.host_peak_bytes)}{band('load.host_peak_bytes')} at its end")
    if ld.time_cold_s is None:
        when = "time not predicted (the profile has no disk rate: `chunkflow calibrate --weights DIR` measures one)"
    else:
        when = (f"{format_seconds(ld.time_cold_s)}{band('load.time_cold_s')} from cold files, "
                f"{format_seconds(ld.time_warm_s)}{band('load.time_warm_s')} from the page cache")
    if getattr(ld, "host_peak_per_host_bytes", None) is not None:  # under SP: every rank's load at once
        return (f"load: {format_bytes(ld.read_bytes)} read by the host's ranks ({ld.read_bytes_source}; what they "
                f"share read once), {when}; host memory {format_bytes(ld.host_peak_per_host_bytes)}"
                f"{band('load.host_peak_per_host_bytes')} per host at its end ({format_bytes(ld.host_peak_bytes)} a "
                "process)")
    return (f"load: {format_bytes(ld.read_bytes)} read ({ld.read_bytes_source}), {when}; host memory "
            f"{format_bytes(ld.host_peak_bytes)}{band('load.host_peak_bytes')} at its end")


def _spread(times: list[float]) -> str:
    """min-max of repeated measurements."""
    return f"{format_seconds(min(times))}-{format_seconds(max(times))}" if times else "-"


def parts_text(timed: dict[str, float], total: float, planned: dict[str, float] | None = None) -> str:
    """Where `total` seconds went: each timed component and the rest, against `planned` (the plan's account, its
    `host` being the rest) where given."""
    def vs(key: str) -> str:
        p = (planned or {}).get(key)
        return f" (planned {format_seconds(p)})" if p is not None else ""

    bits = [f"{k} {format_seconds(v)}{vs(k)}" for k, v in timed.items()]
    bits.append(f"the rest {format_seconds(total - sum(timed.values()))}{vs('host')}")
    return ", ".join(bits)


def parts_line(ph, gpu: bool) -> str:  # noqa: ANN001 - run_generate.PhaseResult
    """Where a phase's time went (parts_text): medians over the measured generations, against the plan on a GPU."""
    import statistics

    timed = {k: statistics.median(v) for k, v in ph.parts_s.items()}
    return parts_text(timed, ph.measured_time_s, ph.predicted_parts_s if gpu else None)


def print_generation(console: Console, report) -> None:  # noqa: ANN001 - chunkflow.reports.RunReport
    """A generation's phases measured (and, on a GPU, against the plan)."""
    g = report.generation
    w = report.plan.workload
    shape = f"{w.width}x{w.height}, " + (f"{w.frames} frames" if w.frames > 1 else f"batch {w.batch}")
    sp = report.run.sp_degree
    where = f"{report.gpu}" + (f", sequence parallel over {sp} processes (rank 0's phases)" if sp > 1 else "")
    console.print(f"[bold]{report.plan.model.name}[/] at {shape}, {g.steps} steps, on {escape(where)}: "
                  f"{escape(repr(g.prompt))}", highlight=False)
    gpu = not report.run.device.startswith("cpu")
    word = (lambda where: where) if gpu else (lambda where: "device (the CPU)" if where == "gpu" else where)
    console.print("placements: " + ", ".join(f"{k} {word(v)}" for k, v in g.components.items())
                  + (", VAE tiled" if g.vae_tiling else ""), highlight=False)
    pp, o = report.plan.prediction, report.plan.offload
    forwards = 1 if o.cfg_batched else report.plan.workload.cfg_passes
    streamed = stream_line(report.stats, g.steps, pp.disk_read_bytes_per_step // forwards or None)
    if streamed:
        console.print(streamed, highlight=False, markup=False)
    if g.cache is not None:
        console.print(cache_line(g.cache), highlight=False, markup=False)
    if g.load is not None:
        console.print(load_line(g.load, gpu), highlight=False, markup=False)
        if g.load.weights == "random":
            console.print(random_output_note(g.output_pixels, w.frames > 1), highlight=False, markup=False)
    console.print(_generation_table(g, gpu))
    _print_generation_notes(console, g, gpu)
    print_band_verdicts(console, report)


def cache_line(c) -> str:  # noqa: ANN001 - reports.CacheResult
    """What the step cache skipped in the measured generations, and the copies spent on what it skipped."""
    calls = c.blocks_computed + c.blocks_skipped
    line = (f"cache {c.label} on {', '.join(c.transformers)}: {c.blocks_skipped} of {calls} block calls skipped "
            f"({c.hit_rate:.0%}) over {c.forwards} forwards")
    if not c.blocks_skipped:
        return line + ("; it skipped nothing: its threshold never fired in these steps, or it does not apply to this "
                       "pipeline (it still ran its own checks each step)")
    steps = [sum(c.skipped_per_forward[i:i + c.forwards_per_step])
             for i in range(0, len(c.skipped_per_forward), c.forwards_per_step)]
    line += f"; steps with skips: {sum(1 for n in steps if n)} of {len(steps)}"
    if c.skipped_h2d_bytes is not None:
        line += f"; {format_bytes(c.skipped_h2d_bytes)} copied to the device for the blocks it skipped"
    return line


def random_output_note(pixels, video: bool) -> str:  # noqa: ANN001 - reports.OutputPixels or None
    """What random weights gave (the output's pixels, where one was written) and what a real checkpoint gives."""
    what = "clip" if video else "picture"
    got = f"the output is {pixels.said(what)}" if pixels is not None else f"the output is not a real {what}"
    why = (": a random VAE decodes any latents to nearly one colour" if pixels is not None and pixels.flat else "")
    return (f"note: the weights are random, so {got}{why}; a real checkpoint gives the video or image the prompt "
            "describes: chunkflow run --plan PLAN --weights DIR_OR_HUB_ID --prompt ...")


def _generation_table(g, gpu: bool) -> Table:  # noqa: ANN001 - reports.GenerationResult
    """Each phase's time (and spread) measured, against the plan's time and peak GPU memory on a GPU."""
    which = (f", after {g.warmup_generations} warm-up generation(s): start-up excluded" if g.warmup_generations
             else ", the process's first: start-up included")
    many = g.measured_generations > 1
    if many:
        which += f"; median of {g.measured_generations} generations"
    t = Table(title="Generation, phase by phase" + (" (measured vs predicted" if gpu else " (measured") + which + ")")
    cols = ["phase", "time"] + (["spread"] if many else []) + (["predicted", "error", "peak GPU memory", "predicted", "error"] if gpu else [])
    for col in cols:
        t.add_column(col, justify="left" if col == "phase" else "right")
    for name, ph in g.phases.items():
        row = [name, format_seconds(ph.measured_time_s)]
        if many:
            row.append(_spread(ph.measured_times_s))
        if gpu:
            row += [format_seconds(ph.predicted_time_s) if ph.predicted_time_s is not None else "-", _pct(ph.time_error),
                    format_bytes(ph.measured_peak_memory_bytes) if ph.measured_peak_memory_bytes is not None else "-",
                    format_bytes(ph.predicted_peak_memory_bytes) if ph.predicted_peak_memory_bytes is not None else "-",
                    _pct(ph.memory_error)]
        t.add_row(*row)
    total = ["[bold]generation[/]", format_seconds(g.generation_time_s)] + ([_spread(g.generation_times_s)] if many else [])
    if gpu:
        pred = g.predicted_generation_time_s
        total += [format_seconds(pred) if pred is not None else "-", _pct(g.generation_time_error), "", "", ""]
    t.add_row(*total)
    return t


def _print_generation_notes(console: Console, g, gpu: bool) -> None:  # noqa: ANN001 - reports.GenerationResult
    """Below the table: the first generation, where each phase's time went, the garbage collector, host memory."""
    if g.first_phase_times_s:
        console.print("first generation: " + ", ".join(f"{k} {format_seconds(v)}" for k, v in g.first_phase_times_s.items())
                      + f", {format_seconds(sum(g.first_phase_times_s.values()))} in all", highlight=False)
    for name, ph in g.phases.items():
        if ph.parts_s:
            console.print(f"{name}: {parts_line(ph, gpu)}", highlight=False)
    gc_each = {name: max(ph.gc_s) for name, ph in g.phases.items() if ph.gc_s}
    if sum(gc_each.values()) >= 0.001:
        console.print("in Python's garbage collector (the most of any measured generation): "
                      + ", ".join(f"{k} {format_seconds(v)}" for k, v in gc_each.items()), highlight=False)
        longest = max(((name, c) for name, ph in g.phases.items() for c in ph.gc_longest if c is not None),
                      key=lambda nc: nc[1].seconds, default=None)
        if longest is not None and longest[1].seconds >= 0.01:
            name, c = longest
            console.print(f"its longest collection: {format_seconds(c.seconds)} in {name}, generation {c.generation}"
                          f"{' (full)' if c.generation == 2 else ''}, {c.collected} objects freed", highlight=False)
    line = f"peak host memory: {format_bytes(g.host_peak_bytes)}"
    if g.host_peak_per_host_bytes is not None:
        ranks = g.host_peak_per_rank_bytes or []
        line = (f"peak host memory of the host: {format_bytes(g.host_peak_per_host_bytes)} ("
                f"{format_bytes(g.host_shared_bytes or 0)} shared once + "
                + " + ".join(format_bytes(b) for b in ranks) + f" of the {len(ranks)} ranks' own)")
    if g.predicted_host_memory_bytes is not None:
        line += f" (predicted {format_bytes(g.predicted_host_memory_bytes)}, {_pct(g.host_memory_error)})"
    console.print(line, highlight=False)
    if not gpu:
        also = ("; host memory is compared (on the CPU the device's memory is host memory)"
                if g.predicted_host_memory_bytes is not None else "")
        console.print("note: measured on the CPU; the plan's times are nominal figures or a GPU's, so they are not "
                      f"compared here{also}.", highlight=False)


def stream_line(stats: dict | None, steps: int, planned_disk: int | None = None) -> str:
    """What the transformer's offload did: blocks streamed from host memory, bytes a step, what stayed on the
    device (empty where nothing streamed)."""
    if not stats or not stats.get("n_streamed_blocks"):
        return ""
    per_step = stats.get("streamed_bytes_per_step", 0) * stats.get("forwards", 0) / max(steps, 1)
    return (f"transformer: {stats['n_streamed_blocks']} of {stats['n_blocks']} blocks streamed from host memory "
            f"({stats['mode']}"
            + (f", {format_bytes(stats['chunk_bytes'])} chunks" if stats.get("chunk_bytes") else "")
            + (": each block one chunk" if stats.get("chunk_bytes") and stats["chunk_bytes"] * stats["n_streamed_blocks"]
               >= stats.get("bytes_offloaded", 0) else "")
            + f"): {format_bytes(per_step)} copied a step, {format_bytes(stats.get('resident_bytes', 0))} of its blocks "
            f"kept on the device ({stats.get('achieved_residency', 0):.0%}"
            + (f" of {stats['target_residency']:.0%} asked: whole chunks of each block"
               if abs(stats.get("achieved_residency", 0) - stats.get("target_residency", 0)) > 0.01 else "")
            + "), "
            f"{format_bytes(stats.get('pinned_bytes') or stats.get('host_bytes', 0))} in host memory"
            + disk_text(stats, planned_disk))


def disk_text(stats: dict, planned_per_forward: int | None = None) -> str:
    """The disk tier's part of the offload's line: blocks read from disk, bytes a forward as measured (what was read
    over the forwards run, the reads ahead included) against the plan's where given, the reads' stall (empty
    without a disk tier)."""
    if not stats.get("disk_blocks"):
        return ""
    measured = stats.get("disk_bytes_read", 0) / max(stats.get("forwards", 0), 1)
    plan = f" (plan: {format_bytes(planned_per_forward)})" if planned_per_forward else ""
    return (f"; {stats['disk_blocks']} blocks read from the checkpoint's files: {format_bytes(measured)} a forward"
            f"{plan}, {format_bytes(stats.get('disk_bytes_read', 0))} in all, "
            f"the copy issuer waited {format_seconds(stats.get('disk_read_stall_s', 0.0))} for reads (the GPU runs what "
            "was queued meanwhile), "
            f"{format_bytes(stats.get('disk_ring_bytes', 0))} ring")


def load_line(ld, gpu: bool = True) -> str:  # noqa: ANN001 - chunkflow.commands.run_generate.LoadResult
    """The build: its time (the start-up before the first read apart) against the plan's for what it read, the read
    rate, the host peak at its end."""
    startup = ld.startup_s or 0.0
    line = f"load: {format_seconds(ld.measured_time_s)}"
    if ld.imports_s:  # the command's start-up is the imports too: said in it, not left out of it
        line = (f"start-up: {format_seconds(ld.imports_s + startup)} ({format_seconds(ld.imports_s)} importing torch "
                f"and diffusers, {format_seconds(startup)} in the load: tokenizers, the modules built"
                + (", the folder checked" if ld.weights != "random" else "") + f"); {line}")
    elif startup > 0:
        line += (f" ({format_seconds(startup)} of start-up: imports, tokenizers, the modules built"
                 + (", the folder checked" if ld.weights != "random" else "") + ")")
    if ld.weights == "random":
        line += f"; random weights drawn in place in {format_seconds(max(ld.measured_time_s - startup, 0.0))}"
    else:
        cached = ("" if ld.cached_fraction is None
                  else f", {ld.cached_fraction:.0%} of it in the page cache before")
        rate = f" at {format_rate(ld.read_bytes / ld.read_seconds)}" if ld.read_seconds > 0 else ""
        line += (f"; {format_bytes(ld.read_bytes)} read in {format_seconds(ld.read_seconds)}{rate}{cached}")
        if ld.pin_seconds:
            line += (f"; {format_seconds(ld.pin_seconds)} page-locking, {format_seconds(ld.pin_wait_seconds or 0.0)}"
                     " of it not hidden by the reads")
        if ld.predicted_time_s is not None:
            line += f" (load predicted {format_seconds(ld.predicted_time_s)}, {_pct(ld.time_error)})"
        elif ld.predicted_host_peak_bytes is not None and gpu:
            line += " (time not predicted: the profile has no disk rate; `chunkflow calibrate --weights DIR`)"
    line += f"; host memory at its end {format_bytes(ld.host_peak_bytes)}"
    if ld.predicted_host_peak_bytes is not None:
        line += f" (predicted {format_bytes(ld.predicted_host_peak_bytes)}, {_pct(ld.host_error)})"
    return line


def memory_drift(trace) -> str:
    """How memory moved over the timed steps: first and last sample of each quantity (flat means no leak)."""
    first, last = trace[0], trace[-1]
    parts = []
    for what, attr in (("allocated", "allocated_bytes"), ("reserved", "reserved_bytes"), ("host RSS", "host_rss_bytes")):
        a, b = getattr(first, attr), getattr(last, attr)
        if a is not None and b is not None:
            parts.append(f"{what} {format_bytes(a)} -> {format_bytes(b)} ({b - a:+,d} B)")
    return f"memory over {len(trace)} timed steps: " + "; ".join(parts)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def codec_rows(m, p) -> list[tuple[str, str, str, str]]:  # noqa: ANN001 - reports.Measured, predict.Predicted
    """The codec measured against planned (none where neither has one): its name, ratio and the bytes it saved."""
    if m.codec == "none" and p.codec == "none":
        return []
    ratio = m.codec_stored_bytes / m.codec_raw_bytes if m.codec_raw_bytes else None
    planned = (f"{p.codec_ratio:.3f} ({'measured' if p.codec_ratio_measured else 'supposed'})"
               if p.codec_ratio is not None else "-")
    return [("codec", m.codec, p.codec, "-" if m.codec == p.codec else "differs"),
            ("codec ratio (stored / raw)", f"{ratio:.3f}" if ratio is not None else "-", planned,
             _pct((ratio - p.codec_ratio) / p.codec_ratio) if ratio is not None and p.codec_ratio else "-"),
            ("bytes saved (host store; a forward's copies)", format_bytes(m.codec_raw_bytes - m.codec_stored_bytes),
             format_bytes(p.codec_raw_bytes - p.codec_stored_bytes), "-")]


def print_run(console: Console, report) -> None:  # noqa: ANN001 - chunkflow.reports.RunReport
    """Measured against predicted for one `chunkflow run`, with relative errors."""
    r, m, p, e = report.run, report.measured, report.predicted, report.rel_error
    o = r.offload
    w = report.plan.workload
    shape = f"{w.width}x{w.height}, " + (f"{w.frames} frames" if w.frames > 1 else f"batch {w.batch}")
    mode = o.mode + (f", chunk {format_bytes(o.chunk_bytes)}, residency {o.residency:.0%}" if o.mode == "chunkflow" else "")
    console.print(
        f"[bold]{report.plan.model.name}[/] at {shape}, {w.cfg_passes} forward(s) per step, mode {mode}, "
        f"on {report.gpu} (SP={r.sp_degree}); {r.steps} timed step(s) after {r.warmup} warm-up",
        highlight=False,
    )
    host = report.plan.hardware.device_is_host  # a CPU plan: nominal times, device memory is host memory
    t = Table(title=f"Measured vs predicted (hardware profile {escape(report.hardware)}, regime {p.regime})")
    for col in ("quantity", "measured", "predicted", "error"):
        t.add_column(col, justify="left" if col == "quantity" else "right")
    median = ("step time (median)" if m.median_steps_counted is None
              else f"step time (median of the {m.median_steps_counted} computed)")
    t.add_row(median, format_seconds(m.median_step_s),
              "- (nominal)" if host else format_seconds(p.step_time_s), _pct(e.step_time))
    dev = report.plan.hardware.device_word
    peak = (format_bytes(m.peak_allocated_bytes) if m.peak_allocated_bytes is not None
            else "- (not measured)" if host else "- (no GPU)")
    t.add_row(f"peak {dev} memory (allocated)", peak, format_bytes(p.peak_memory_bytes), _pct(e.peak_memory))
    if m.peak_reserved_bytes is not None:
        t.add_row(f"peak {dev} memory (reserved)", format_bytes(m.peak_reserved_bytes), "-", "-")
    if host:
        held = (report.stats or {}).get("host_bytes", 0)
        t.add_row("host store (not page-locked)", format_bytes(held), format_bytes(p.pinned_host_bytes), "-")
    else:
        t.add_row("pinned host memory", format_bytes(m.pinned_host_bytes), format_bytes(p.pinned_host_bytes), "-")
    if m.achieved_residency is not None and o.mode == "chunkflow":
        t.add_row("residency (achieved / asked)", f"{m.achieved_residency:.1%}", f"{o.residency:.1%}", "-")
    for row in codec_rows(m, p):
        t.add_row(*row)
    console.print(t)
    shown = m.step_times_s if len(m.step_times_s) <= 12 else m.step_times_s[:6] + m.step_times_s[-6:]
    console.print("step times: " + ", ".join(format_seconds(x) for x in shown)
                  + (f" ({len(m.step_times_s)} steps, first and last 6 shown)" if len(shown) < len(m.step_times_s) else ""),
                  highlight=False)
    if len(m.memory_trace) > 1:
        console.print(memory_drift(m.memory_trace), highlight=False)
    if r.device.startswith("cpu") and host:
        console.print("note: a plan for the CPU: its times are nominal figures, not predictions, so they are not "
                      "compared; this run checks the pipeline end to end and what it holds in host memory.",
                      highlight=False, markup=False)
    elif r.device.startswith("cpu"):
        console.print(f"note: the prediction is for the GPU profile {report.plan.hardware.name!r}; on the CPU this run "
                      "checks the pipeline end to end, not the planner's accuracy (run it on that GPU for that).",
                      highlight=False, markup=False)
    if report.generation is None:  # a generation's verdicts follow its own table (print_generation)
        print_band_verdicts(console, report)


_BAND_LABELS = {"step_time_s": "step time (median)", "peak_memory_bytes": "peak memory (allocated)",
                "generation_time_s": "generation", "host_memory_bytes": "host memory (peak)", "load.time_s": "load time",
                "load.host_peak_bytes": "host memory at the load's end"}


def _band_label(key: str) -> str:
    if key.startswith("phases."):
        _, phase, what = key.split(".", 2)
        return f"{phase} {'time' if what == 'time_s' else 'peak memory'}"
    return _BAND_LABELS.get(key, key)


def print_band_verdicts(console: Console, report) -> None:  # noqa: ANN001 - chunkflow.reports.RunReport
    """Each measurement against its prediction's band: inside or outside, and what a miss leaves to do."""
    verdicts = report.bands
    if not verdicts:
        return
    t = Table(title="Measured against the plan's bands (about 95% of runs on the machine the profile describes)")
    for col in ("quantity", "error", "band", "verdict"):
        t.add_column(col, justify="left" if col in ("quantity", "verdict") else "right")
    for key, v in verdicts.items():
        t.add_row(_band_label(key), f"{v.error:+.1%}", _verdict_band(v), "inside" if v.inside else "[bold]outside[/]")
    console.print(t)
    out = [k for k, v in verdicts.items() if not v.inside]
    line = f"{len(verdicts) - len(out)} of {len(verdicts)} measurements inside their bands"
    if out:
        own = "the planner's own error"
        line += ("; outside: " + "; ".join(
            f"{_band_label(k)} (its band is widest from {', '.join(verdicts[k].fits) or own})" for k in out) + ". A miss says this run differed from what the profile measured (another load on the "
            "machine, a cold cache) or the model is off: `chunkflow calibrate --from-report REPORT` folds the run "
            "into the profile's errors, and the next plan's bands")
    console.print(line, highlight=False, markup=False)
