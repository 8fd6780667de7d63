"""How sure a plan is: the band each prediction carries, from the fits it depends on and the planner's own error.

A profile's constants come from fits (`chunkflow calibrate`): each fit keeps its samples' spread about it
(`HardwareSpec.fits`, a FitQuality by the names of FITS below). A prediction's band propagates those spreads to
first order: each fit's constants are moved by +-Z x its spread, the chosen plan is priced again with everything
else held (the same placements, chunk size and residency), and the relative changes are summed in quadrature.
To that goes the planner's own error on that kind of prediction (QUANTITY_KINDS): from the run reports the profile
was refit from (`HardwareSpec.model_errors`: |bias| + Z x spread), else MODEL_PRIOR. A fit the profile has no record
of (a catalog entry, a figure calibrate does not measure) counts at its prior spread, and the band says so
(`Band.measured`).

    band = sqrt( sum_k (d q / q at k +- Z s_k)^2 + m_q^2 )

So a band is a ~95% interval for one measurement of the same run on the machine the profile describes, if the
samples calibrate took are like the samples the run will see.

A load's time is the exception to m_q's source where `calibrate --weights` timed the load path itself (the `load`
fit: a sample of the folder read into a host store page-locked while it is read, against what the load model
predicts for those bytes) and no run report says it: its bias b and spread s (with its drift) stand for the prior,
and the fits that path ran through (LOAD_PATH_FITS) are not moved again, so the band is centred on the bias:

    low = -max(0, h - b),  high = max(0, h + b),   h = sqrt( sum_k others^2 + (Z x s)^2 )

A process's first generation pays a one-time start-up in each phase (`PipelineProfile.startup_s`: kernels loaded on
first use, library handles, the allocator's first growth). It is not moved with the other fits: it only adds, and it
moved by a factor of four between starts of one H200 (docs/bands-h200.md), which no multiplicative move of a
figure holds. It is its own one-sided term (with_startup): a first generation's time (a phase's, the generation's)
has the band of its warm time (the same time less the start-up, `*.warm_time_s`) with the start-up's own band
added edge to edge,

    low = warm low,    high = warm high + s x (1 + Z x sd) + c x (1 + Z x sd_c)

s the start-up (the mean over cold processes and reports, `startup_samples_s`), sd its samples' relative spread
(the `startup` fit; STARTUP_PRIOR without a record), c what a freshly started machine adds to it (its libraries
read from the disk at their first use: `calibrate`'s first cold process runs with them dropped from the page cache,
keyed `cold:<phase>` in startup_s; 0 unmeasured; `Band.startup_cold_s` holds its part of the high edge, which a run
that started with the libraries cached is judged without: reports.band_verdicts), sd_c its own spread: the `cold:*`
samples about their means where COLD_MIN_SAMPLES are kept, else STARTUP_PRIOR (cold_spread; calibrate measures one
cold process, and two cold first generations of one pipeline paid values far apart: docs/data/gpu-firstgen/README.md,
round 3). One-sided: the low edge takes
none of the start-up, which is measured on the calibrated model's kernels, and another pipeline's can be almost none
(PixArt-Sigma's denoise paid 0.03 s where Wan2.2-5B's probe paid 0.20 s, on an H100). So that band is asymmetric
(`Band.rel_low`, `Band.rel_high`) and a warm generation's carries none of it. What narrows it: calibrate again
(more samples, a quieter machine), and `calibrate --from-report` with runs of this machine (a measured m_q in place of the prior).

A transformer class no calibration measured has its activations priced as an upper bound (the default model times
chunkflow/models/derive.py's ACTIVATION_MARGIN, `ActivationModel.prior_multiple`): its GPU peaks' bands are one-sided
below too, their low edges the plan priced again at the default model (planner.with_activation_prior).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field

from chunkflow_planner.catalog import QUANTITY_KINDS, HardwareSpec  # noqa: F401  (QUANTITY_KINDS re-exported)

Z = 2.0  # the band's half-width in spreads (a normal sample's ~95%)
FLAG_SPREAD = 0.10  # a fit whose samples spread wider than this about it is too loose to plan with (calibrate flags it)
MAX_RESIDUALS = 256  # residuals a FitQuality keeps


@dataclass(frozen=True)
class Fit:
    """One fit of the profile: what it measures, its spread where the profile has no record of it, what to repeat to
    narrow it, how moving it by a factor k (1 + relative change, faster or larger when k > 1) changes the profile,
    and the command that records its spread (None: measured once or not at all, so its prior always stands)."""

    what: str
    prior: float
    repeat: str
    move: Callable[[HardwareSpec, float], HardwareSpec]
    recorded_by: str | None = "chunkflow calibrate"
    drift: float | None = None  # the change from one calibration to the next where the profile has not measured it
    additive: bool = False  # a one-sided term added to the bands of the times it is in (with_startup), not moved
    values: Callable[[HardwareSpec], list[tuple[str, float]]] = lambda hw: []  # what it says, to compare two of it

    @property
    def drift_prior(self) -> float:
        """The run-to-run drift a once-calibrated fit gets: the H200's where measured (DRIFT_SOURCE), else its prior."""
        return self.prior if self.drift is None else self.drift


def _scale(*keys: str) -> Callable[[HardwareSpec, float], HardwareSpec]:
    """Every figure named, times k (absent figures stay absent)."""
    def move(hw: HardwareSpec, k: float) -> HardwareSpec:
        update = {}
        for key in keys:
            v = hw.figure(key)
            if isinstance(v, dict):
                update[key] = {n: x * k for n, x in v.items()}
            elif v is not None:
                update[key] = v * k
        return hw.model_copy(update=update) if update else hw  # nothing to move: the profile itself
    return move


# the decodes a VAE fit is read at to compare two of it: an image's (1 Mi voxels of 1 Mi pixels, 8 tiled decoder
# calls) and a video's (32 Mi voxels of 0.4 Mi pixels, 64 calls); its constant terms alone are small parts of these
VAE_READS = ((2**20, 2**20, 8), (2**25, 400_000, 64))


def _vae_figures(kind: Literal["time", "mem"]) -> Callable[[HardwareSpec], list[tuple[str, float]]]:
    """What each measured VAE decode fit (and its tiled fit) says at VAE_READS: time (or peak memory)."""
    def at(fit, voxels: int, px: int, calls: int) -> float:
        if kind == "time":
            return max(0.0, fit.time_const) + fit.time_per_voxel * voxels + fit.time_per_call * calls
        return fit.mem_const + fit.mem_per_px * px + fit.mem_per_voxel * voxels

    def values(hw: HardwareSpec) -> list[tuple[str, float]]:
        out = []
        for name, fit in sorted(hw.pipeline.vae_decode.items()):
            for label, f, tiled in ((name, fit, False), (f"{name} tiled", fit.tiled, True)):
                if f is not None:
                    out += [(f"{label} at {v / 2**20:.0f} Mi voxels", at(f, v, px, c if tiled else 1))
                            for v, px, c in VAE_READS]
        return out
    return values


def _vae(kind: Literal["time", "mem"]) -> Callable[[HardwareSpec, float], HardwareSpec]:
    """Every VAE decode fit's time (or memory) coefficients, times k, tiled fits too."""
    keys = ("time_const", "time_per_voxel", "time_per_call") if kind == "time" else \
        ("mem_const", "mem_per_px", "mem_per_voxel")

    def move(hw: HardwareSpec, k: float) -> HardwareSpec:
        def scaled(fit):
            update = {key: getattr(fit, key) * k for key in keys}
            if fit.tiled is not None:
                update["tiled"] = scaled(fit.tiled)
            return fit.model_copy(update=update)

        if not hw.pipeline.vae_decode:
            return hw
        return hw.model_copy(update={"vae_decode": {n: scaled(f) for n, f in hw.pipeline.vae_decode.items()}})
    return move


def _compute(hw: HardwareSpec, k: float) -> HardwareSpec:
    """The device's compute rate times k: every efficiency is relative to P_peak, and memory-bound passes run at
    the memory bandwidth."""
    return hw.model_copy(update={"peak_tflops": hw.peak_tflops * k, "hbm_gbps": hw.hbm_gbps * k})


def _slower(*keys: str) -> Callable[[HardwareSpec, float], HardwareSpec]:
    """Figures that are times or sizes: k > 1 (a faster machine) divides them."""
    inner = _scale(*keys)
    return lambda hw, k: inner(hw, 1.0 / k)


def _h2d(hw: HardwareSpec, k: float) -> HardwareSpec:
    """The copies' fit: the link's rate times k and each copy's start-up over k (a slower link, slower starts)."""
    return hw.model_copy(update={"h2d_link_gbps": hw.h2d_link_gbps * k, "dma_startup_us": hw.dma_startup_us / k})


def _figures(*keys: str) -> Callable[[HardwareSpec], list[tuple[str, float]]]:
    """The figures named, by key (a dict figure by key and entry), absent ones left out."""
    def values(hw: HardwareSpec) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        for key in keys:
            v = hw.figure(key)
            if isinstance(v, dict):
                out += [(f"{key} {n}", float(x)) for n, x in sorted(v.items())]
            elif v is not None:
                out.append((key, float(v)))
        return out
    return values


def _eta_points(hw: HardwareSpec) -> list[tuple[str, float]]:
    """Each measured eta_comp curve's points: the compute fit's figures (relative to P_peak, which it keeps)."""
    return [(f"eta {m} @ {f:.3g} FLOP", float(e)) for m, c in sorted(hw.eta_comp_curves.items()) for f, e in c]


def _copy_times(hw: HardwareSpec) -> list[tuple[str, float]]:
    """What the H2D fit says: the time of a 1 MiB and a 64 MiB copy (its start-up alone is a few us of them)."""
    return [(f"copy {n} MiB", hw.dma_startup_us * 1e-6 + n * 2**20 / (hw.h2d_link_gbps * 1e9)) for n in (1, 64)]


def _codec_ratio(hw: HardwareSpec, k: float) -> HardwareSpec:
    """The codec's stored / raw bytes over k, at most 1 (a codec never stores more than the raw bytes: a chunk that
    would not shrink is kept raw)."""
    if hw.codec_ratio is None:
        return hw
    return hw.model_copy(update={"codec_ratio": min(1.0, hw.codec_ratio / k)})


# The start-up's spread where no cold process or report measured it: the H200's first generations (docs/bands-h200.md)
# paid 1.3x to 5x the catalog's start-up; at 1.0 its band reaches 3x the figure, and down to none of it. A freshly
# started machine's extra start-up has it too until COLD_MIN_SAMPLES samples say its spread (cold_spread): two cold
# first generations of PixArt-Sigma on one H100 paid values far apart over its warm denoise (docs/data/gpu-firstgen/
# README.md, round 3), where calibrate's one cold process measures a single value.
STARTUP_PRIOR = 1.0
COLD_MIN_SAMPLES = 3  # `cold:*` samples (of keys with two or more) that measure the cold part's spread

# The change from one calibration to the next of the fits two pairs of calibrations of one H200 measured
# (DRIFT_SOURCE): the root mean square of second / first - 1 over each fit's figures (drift_between), pooled over the
# pairs as calibrate pools them (with_drift), rounded up. The host's own work (CPU matmuls, dispatching layers,
# first touches, page-locking) moved 1-36% where each run's samples spread 1-10%; the GPU's compute and copies 0.1-0.8%.
DRIFT_H200: dict[str, float] = {"compute": 0.01, "h2d": 0.005, "text_host": 0.20, "cpu": 0.26, "codec_decode": 0.10,
                                "page_cache": 0.08, "pin": 0.17, "host_fault": 0.20, "vae_time": 0.05}
DRIFT_SOURCE = ("docs/data/h200-bands/run/compare.json and run-2/compare34.json (two pairs of `chunkflow calibrate` "
                "of one H200, 2026-12-04)")

# The load path timed by `calibrate --weights` (the `load` fit: a sample of the folder read into a host store that is
# page-locked while it is read, as the loader does) against the load model's prediction for those bytes. Its spread
# and bias replace, on a plan's load times, the planner's prior for the load (MODEL_PRIOR) and the moves of the fits
# that path ran through (LOAD_PATH_FITS: it measured them together, as the load meets them). Its drift where only one
# calibration measured it: the cold loads of three runs on one H200 against their plans (+6.5%, +17.4%, +18.2%,
# docs/bands-h200.md) moved about 6% about their middle, rounded up.
LOAD_DRIFT = 0.10
LOAD_PATH_FITS = ("disk_read", "page_cache", "pin", "host_fault")


def _load_ratio(hw: HardwareSpec) -> list[tuple[str, float]]:
    """What the load fit says: the load path's time over the model's (1 + its bias), to compare two of it."""
    q = hw.fits.get("load")
    return [] if q is None else [("load measured / predicted", 1.0 + q.bias)]


FITS: dict[str, Fit] = {
    "compute": Fit("the blocks' compute rate (eta_comp curves, GEMM and attention tables)", 0.03,
                   "the block timings: `chunkflow calibrate --model MODEL` on an idle GPU", _compute,
                   drift=DRIFT_H200["compute"], values=_eta_points),
    "h2d": Fit("pinned host-to-device copies (h2d_link_gbps, dma_startup_us)", 0.02,
               "the H2D copies: nothing else on the PCIe link or the host's memory while calibrate runs",
               _h2d, drift=DRIFT_H200["h2d"], values=_copy_times),
    "collectives": Fit("the all-to-all rate and its contention with copies (coll_gbps)", 0.05,
                       "the collectives: calibrate under torchrun with every GPU idle", _scale("coll_gbps"),
                       values=_figures("coll_gbps")),
    "block_overhead": Fit("the runtime's cost per streamed block (block_overhead_us)", 0.25,
                          "`chunkflow calibrate --from-report` with offloaded runs", _slower("block_overhead_us"),
                          "chunkflow calibrate --from-report", drift=0.0),  # from runs: its spread is between runs
    "disk_read": Fit("the disk's cold read rate (disk_read_gbps)", 0.08,
                     "the disk reads: `chunkflow calibrate --weights DIR` with nothing else reading that disk",
                     _scale("disk_read_gbps"), None),
    "page_cache": Fit("reads the page cache holds (page_cache_gbps)", 0.05, "the warm reads: calibrate --weights DIR",
                      _scale("page_cache_gbps"), drift=DRIFT_H200["page_cache"],
                      values=_figures("page_cache_gbps")),
    "pin": Fit("page-locking host memory (pin_gbps)", 0.05, "page-locking: calibrate with the host's memory free",
               _scale("pin_gbps"), drift=DRIFT_H200["pin"], values=_figures("pin_gbps")),
    "host_fault": Fit("new host memory at its first touch (host_fault_gbps)", 0.05,
                      "first touches: calibrate with the host's memory free", _scale("host_fault_gbps"),
                      drift=DRIFT_H200["host_fault"], values=_figures("host_fault_gbps")),
    "load_startup": Fit("a pipeline's build outside its reads (load_startup_s)", 0.08,
                        "the load's start-up: calibrate --weights DIR", _slower("load_startup_s"), None),
    "vae_time": Fit("the VAE decodes' times (vae_decode)", 0.03, "the VAE decodes: calibrate on an idle GPU",
                    _vae("time"), drift=DRIFT_H200["vae_time"], values=_vae_figures("time")),
    "vae_memory": Fit("the VAE decodes' peak memory (vae_decode)", 0.03, "the VAE decodes: calibrate",
                      _vae("mem"), values=_vae_figures("mem")),
    "text_host": Fit("the host's dispatch of text-encoder layers (text_layer_host_us)", 0.05,
                     "the text-encoder dispatch: calibrate with the CPU otherwise idle",
                     _slower("text_layer_host_us", "encode_host_s"), drift=DRIFT_H200["text_host"],
                     values=_figures("text_layer_host_us")),
    "cpu": Fit("the CPU's matmul rate (cpu_tflops)", 0.05, "the CPU matmuls: calibrate with the CPU otherwise idle",
               _scale("cpu_tflops"), drift=DRIFT_H200["cpu"], values=_figures("cpu_tflops")),
    "codec_decode": Fit("the codec's decode rate (codec_decode_gbps)", 0.05, "the codec decode: calibrate --weights DIR",
                        _scale("codec_decode_gbps"), drift=DRIFT_H200["codec_decode"],
                        values=_figures("codec_decode_gbps")),
    "codec_ratio": Fit("the codec's stored / raw bytes (codec_ratio)", 0.01, "the codec ratio: calibrate --weights DIR",
                       _codec_ratio, None),
    "context": Fit("device memory torch does not count (context_bytes)", 0.03, "calibrate on an idle GPU",
                   _slower("context_bytes"), None),
    "process_host": Fit("a process's own host memory (process_host_bytes, process_start_host_bytes)", 0.03,
                        "calibrate", _slower("process_host_bytes", "process_start_host_bytes"), None),
    "startup": Fit("a process's first-generation start-up (startup_s)", STARTUP_PRIOR,
                   "the start-up: `chunkflow calibrate` (cold processes) and `calibrate --from-report` with runs made "
                   "with --warmup", _slower("startup_s"), "chunkflow calibrate", drift=0.0,  # its samples are runs
                   additive=True),
    "load": Fit("the load path against the load model (measured / predicted load time of a sample)",
                0.30, "the load path: calibrate --weights DIR with nothing else reading that disk",
                lambda hw, k: hw, "chunkflow calibrate --weights DIR", drift=LOAD_DRIFT, values=_load_ratio),
    # (its prior is MODEL_PRIOR's load_time; it moves no figure: bands() reads it as the load's own error)
}


# The planner's own error by kind where no run report of the machine says it: about the largest warm errors the
# committed H200 runs measured (docs/planner-accuracy-h200.md: step 6.7%, peak 6.3%; docs/measurements.md: a load
# +5.8% to +30% against its plan).
MODEL_PRIOR: dict[str, float] = {"step_time": 0.07, "phase_time": 0.10, "generation_time": 0.08,
                                 "peak_memory": 0.07, "host_memory": 0.07, "load_time": 0.30}


def kind_of(key: str) -> str:
    """The QUANTITY_KINDS entry of a prediction's key (its path in the plan's prediction)."""
    if key.startswith("load."):
        return "load_time" if key.endswith("_s") else "host_memory"
    if key.startswith("phases."):
        return "phase_time" if key.endswith("time_s") else "peak_memory"
    if key == "step_time_s":
        return "step_time"
    if key.startswith("generation_"):  # generation_time_s, and generation_warm_time_s after a warm-up
        return "generation_time"
    if key in ("host_memory_bytes", "pinned_host_bytes"):
        return "host_memory"
    return "peak_memory"


class Band(BaseModel):
    """A prediction's band: value x (1 +- rel)."""

    model_config = ConfigDict(extra="allow", frozen=True, allow_inf_nan=False)

    rel: float = Field(ge=0, le=1000, description="half-width, a share of the prediction (0.06: +-6%); of an "
                       "asymmetric band (a first generation's time) its wider side")
    low: float = Field(description="the prediction x (1 - rel_low), at least 0")
    high: float = Field(description="the prediction x (1 + rel_high)")
    rel_low: float | None = Field(None, ge=0, le=1000, description="how far below the prediction `low` is, a share "
                                  "of it; None: rel (a symmetric band)")
    rel_high: float | None = Field(None, ge=0, le=1000, description="how far above the prediction `high` is, a "
                                   "share of it; None: rel")
    startup_s: tuple[float, float] | None = Field(None, description="a first generation's time: the start-up's own "
                                                  "low and high (seconds) added to its warm band's edges (with_startup)")
    startup_cold_s: float | None = Field(None, ge=0, description="of the high edge, the seconds only a freshly "
                                         "started machine takes (its libraries read from the disk: cold_extra); a "
                                         "run that started with them cached is held to the edge without them")
    fits: list[str] = Field(default_factory=list, description="the fits that move it most, widest first")
    measured: bool = Field(description="whether every fit it depends on was measured on this machine (else a "
                           "prior spread stood in: bands.FITS)")
    supposed: list[str] = Field(default_factory=list, description="the fits that moved it at their prior spread (the "
                                "profile has no record of them)")
    model: str = Field("", description="where the planner's own error came from: run reports, or the prior")

    def contains(self, measured: float) -> bool:
        """Whether a measurement falls inside the band."""
        return self.low <= measured <= self.high

    def edges(self) -> tuple[float, float]:
        """(below, above): how far the band reaches below and above the prediction, shares of it."""
        return (self.rel if self.rel_low is None else self.rel_low,
                self.rel if self.rel_high is None else self.rel_high)

    def without_cold(self) -> "Band":
        """The band of a first generation whose libraries were cached: the high edge less `startup_cold_s`."""
        if not self.startup_cold_s:
            return self
        value = self.high / (1.0 + self.edges()[1])
        high = self.high - self.startup_cold_s
        below, above = self.edges()[0], high / value - 1.0
        return self.model_copy(update=dict(high=high, rel_high=above, rel=max(below, above), startup_cold_s=None))

    def holds(self, error: float) -> bool:
        """Whether a measurement `error` (measured / predicted - 1) off the prediction falls inside the band."""
        below, above = self.edges()
        return -below - 1e-12 <= error <= above + 1e-12


def startup_edges(hw: HardwareSpec, startup: float, cold: float = 0.0) -> tuple[float, float, bool]:
    """The start-up's own band, one-sided: (0, high) seconds of a start-up figure `startup`, high at +Z x its
    samples' spread, and what a freshly started machine adds to it (`cold`) at +Z x its own (cold_edge); and whether
    both spreads were measured (else a prior stood in: STARTUP_PRIOR)."""
    sd, measured = spread_of(hw, "startup")
    cold_measured = cold <= 0 or cold_spread(hw)[1]
    return 0.0, startup * (1.0 + Z * sd) + cold_edge(hw, cold), measured and cold_measured


def cold_spread(hw: HardwareSpec) -> tuple[float, bool]:
    """The relative spread of a freshly started machine's extra start-up (c = cold:<phase> - <phase>) and whether it
    was measured: the `cold:*` samples of startup_samples_s (keys with two or more) about their key's mean, as shares
    of that key's c, pooled (one value fitted a key: spread(fitted=keys)), where COLD_MIN_SAMPLES of them are kept;
    else STARTUP_PRIOR (calibrate's one cold process says nothing of how far the next one's moves)."""
    st = hw.pipeline.startup_s
    residuals: list[float] = []
    keys = 0
    for key, xs in hw.pipeline.startup_samples_s.items():
        if not key.startswith("cold:") or len(xs) < 2:
            continue
        mean = sum(xs) / len(xs)
        c = mean - st.get(key.removeprefix("cold:"), 0.0)
        if c > 0:
            residuals += [(x - mean) / c for x in xs]
            keys += 1
    if len(residuals) < COLD_MIN_SAMPLES:
        return STARTUP_PRIOR, False
    return min(10.0, spread(residuals, fitted=keys)), True


def cold_edge(hw: HardwareSpec, cold: float) -> float:
    """Of startup_edges' high, the seconds `cold` (a freshly started machine's extra) adds: c (1 + Z sd_c)."""
    return cold * (1.0 + Z * cold_spread(hw)[0]) if cold > 0 else 0.0


PHASES = ("encode", "denoise", "decode")
FIRST_AND_WARM = [(f"phases.{n}.time_s", f"phases.{n}.warm_time_s") for n in PHASES] + \
    [("generation_time_s", "generation_warm_time_s")]


def cold_extra(hw: HardwareSpec, first: str) -> float:
    """What a freshly started machine adds to the start-up of `first` (a phase's time, or the generation's: the
    three phases'): `cold:<phase>` less `<phase>` in the profile's startup_s, 0 where either is missing."""
    st = hw.pipeline.startup_s
    phases = PHASES if first == "generation_time_s" else (first.split(".")[1],)
    return sum(max(0.0, st[f"cold:{n}"] - st[n]) for n in phases if f"cold:{n}" in st and n in st)


def with_startup(found: Mapping[str, Band], values: Mapping[str, float], hw: HardwareSpec) -> dict[str, Band]:
    """The bands of a first generation's times (a phase's, the generation's): their warm band's edges plus the
    start-up's own (startup_edges; the start-up is the time less its warm time), asymmetric (module docstring).
    A time without a warm one (no start-up) keeps its band."""
    out = dict(found)
    for first, warm in FIRST_AND_WARM:
        v, w, wb = values.get(first), values.get(warm), found.get(warm)
        if not v or not w or wb is None or v <= w:
            continue
        cold = cold_extra(hw, first)
        lo, hi, measured = startup_edges(hw, v - w, cold)
        low, high = wb.low + lo, wb.high + hi
        below, above = max(0.0, 1.0 - low / v), high / v - 1.0
        out[first] = wb.model_copy(update=dict(
            rel=max(below, above), rel_low=below, rel_high=above, low=low, high=high, startup_s=(lo, hi),
            startup_cold_s=cold_edge(hw, cold) if cold > 0 else None,
            fits=["startup", *wb.fits][:3] if hi - (v - w) > wb.high - w else [*wb.fits, "startup"][:4],
            measured=wb.measured and measured, supposed=[*wb.supposed, *([] if measured else ["startup"])]))
    return out


def spread_of(hw: HardwareSpec, name: str) -> tuple[float, bool]:
    """A fit's spread for a run and whether it was measured: from the profile's record, its samples' spread and the
    drift from one calibration to the next in quadrature (the record's drift, else the fit's drift prior: a run is
    another time, and a within-run spread does not see the machine's change between runs); without a record, the
    fit's prior."""
    q = hw.fits.get(name)
    if q is None:
        return FITS[name].prior, False
    return math.hypot(q.spread, q.drift if q.drift is not None else FITS[name].drift_prior), True


def drift_between(old: HardwareSpec, new: HardwareSpec) -> dict[str, float]:
    """By fit measured in both profiles (their `fits`), the root mean square of new / old - 1 over the fit's figures
    (Fit.values) both hold: how far one calibration of a machine moved from the one before."""
    out = {}
    for name in sorted(set(old.fits) & set(new.fits)):
        was = dict(FITS[name].values(old))
        changes = [v / was[k] - 1 for k, v in FITS[name].values(new) if was.get(k, 0) > 0 and math.isfinite(v)]
        if changes:
            out[name] = math.sqrt(sum(c * c for c in changes) / len(changes))
    return out


def with_drift(old: HardwareSpec, new: HardwareSpec, changes: Mapping[str, float] | None = None) -> HardwareSpec:
    """`new` with each fit's drift measured against `old`, a calibration of the same machine before it, pooled with
    the drift `old` had recorded (a mean of squares over the pairs); a fit with nothing to compare keeps old's record.
    `changes`: drift_between(old, new) where the caller has it already."""
    changes = drift_between(old, new) if changes is None else changes
    fits = dict(new.fits)
    for name, q in new.fits.items():
        before = old.fits.get(name)
        pairs, drift = (before.drift_pairs, before.drift) if before is not None and before.drift is not None else (0, 0.0)
        if name in changes:
            drift = math.sqrt((pairs * drift * drift + changes[name] ** 2) / (pairs + 1))
            pairs += 1
        if pairs:
            fits[name] = q.model_copy(update={"drift": min(drift, 10.0), "drift_pairs": pairs})
    return new.model_copy(update={"fits": fits})


def model_error(hw: HardwareSpec, kind: str) -> tuple[float, str]:
    """The planner's own error on `kind` (a half-width): from the profile's run reports, else the prior."""
    e = hw.model_errors.get(kind)
    if e is not None:
        return abs(e.bias) + Z * e.spread, f"{kind} from run reports ({e.samples} error(s) in {e.reports} report(s))"
    return MODEL_PRIOR[kind], "prior (no run reports)"


def load_error(hw: HardwareSpec) -> tuple[float, float, str] | None:
    """The load's own error where `calibrate --weights` timed the load path and no run report says it: (half-width
    Z x the fit's spread with its drift, bias, where from); None otherwise (model_error stands)."""
    q = hw.fits.get("load")
    if q is None or "load_time" in hw.model_errors:
        return None
    s, _ = spread_of(hw, "load")
    return Z * s, q.bias, f"load path measured ({q.samples} load(s), bias {q.bias:+.1%}): {q.source}"


def _band(value: float, var: float, parts: list[tuple[float, str]], supposed: list[str], hw: HardwareSpec,
          key: str) -> Band:
    """The band of one prediction `value` from the fits' summed variance `var` and the planner's own error on its
    kind; a load time with a measured load fit (load_error) is centred on its bias, so asymmetric."""
    fits = [n for _, n in sorted(parts, reverse=True)[:3]]
    loaded = load_error(hw) if kind_of(key) == "load_time" else None
    if loaded is None:
        m, source = model_error(hw, kind_of(key))
        rel = min(1000.0, math.sqrt(var + m * m))
        return Band(rel=rel, low=value * max(0.0, 1 - rel), high=value * (1 + rel), fits=fits,
                    measured=not supposed, supposed=supposed, model=source)
    m, bias, source = loaded
    half = math.sqrt(var + m * m)
    below, above = min(1000.0, max(0.0, half - bias)), min(1000.0, max(0.0, half + bias))
    return Band(rel=max(below, above), rel_low=below, rel_high=above, low=value * max(0.0, 1 - below),
                high=value * (1 + above), fits=["load", *fits][:3], measured=not supposed, supposed=supposed,
                model=source)


def bands(price: Callable[[HardwareSpec], Mapping[str, float]], hw: HardwareSpec,
          base: Mapping[str, float] | None = None) -> dict[str, Band]:
    """The band of every prediction `price(hw)` gives (key -> value), by moving each fit of FITS (module docstring).
    A fit whose figures the profile lacks prices nothing and is skipped; one whose moved profile cannot be priced
    (a figure out of the planner's range) counts as moving every prediction by 100%, named in the band's fits. A
    load time with a measured load fit (load_error) leaves out the fits its path measured (LOAD_PATH_FITS)."""
    base = dict(price(hw) if base is None else base)
    keys = [k for k, v in base.items() if v is not None and math.isfinite(v) and v > 0]
    var = {k: 0.0 for k in keys}
    parts: dict[str, list[tuple[float, str]]] = {k: [] for k in keys}
    supposed: dict[str, list[str]] = {k: [] for k in keys}
    for name, fit in FITS.items():
        s, measured = spread_of(hw, name)
        if s <= 0 or fit.additive:
            continue
        step = min(Z * s, 0.9)
        moved_up = fit.move(hw, 1 + step)
        if moved_up is hw:  # the profile has none of its figures (no disk rate, no codec): it prices nothing
            continue
        try:
            up, down = price(moved_up), price(fit.move(hw, 1 - step))
        except (ValueError, ArithmeticError):  # pydantic's ValidationError is a ValueError
            up = down = None
        for k in keys:
            if name in LOAD_PATH_FITS and kind_of(k) == "load_time" and load_error(hw) is not None:
                continue
            if up is None:
                d = 1.0
            else:
                hi, lo = up.get(k), down.get(k)
                if hi is None or lo is None:
                    continue
                d = max(abs(hi - base[k]), abs(lo - base[k])) / base[k]
            if d > 1e-9:
                var[k] += d * d
                parts[k].append((d, name))
                if not measured:
                    supposed[k].append(name)
    return {k: _band(base[k], var[k], parts[k], supposed[k], hw, k) for k in keys}


def spread(residuals: list[float], fitted: int = 0) -> float:
    """A sample's robust relative spread from its residuals about a fit of `fitted` parameters: 1.4826 x the median
    of the n - fitted largest |residuals| (a normal sample's standard deviation; with fitted 0, of all of them).

    A fit pulls its residuals in: the median of 3 repeats is one of them (its residual exactly 0), a 3-coefficient
    fit through 4 decodes leaves one degree of freedom. Each parameter can zero about one residual, so the `fitted`
    smallest say nothing of the spread and are left out. The variance's correction, sqrt(n / (n - fitted)) on the
    median of all, is too little for a median: on simulated N(0, 3%) noise in groups of 3 about their median the
    median of every |residual| gives 1.4% and x sqrt(3/2) 1.7%, where this gives 3.1%; through 4-point,
    3-coefficient line fits 1.1%, 2.1% and 3.4% (tests/test_calibrate_fits.py)."""
    xs = sorted(abs(r) for r in residuals)[max(0, fitted):]
    if not xs:
        return 0.0
    n = len(xs)
    return 1.4826 * (xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2]))
