"""A process's one-time start-up per phase (`PipelineProfile.startup_s`): kernels loaded on first use, library
handles, the allocator's first growth. Measured as first less later: by `chunkflow calibrate` in several cold
processes (each its own Python, each phase's component called twice: measure_startup), and by
`calibrate --from-report` from generations run with --warmup (refit._refit_startup). A freshly started machine's
(its libraries read from the disk at first use) is measured once, first, keyed `cold:<phase>` (the band's high edge:
bands.with_startup). Every sample is kept by its key
(`startup_samples_s`, the newest MAX_SAMPLES): the figure is their mean (a one-sided term adds its mean to a
generation's), its spread their relative spread about it, the `startup` fit (bands.with_startup)."""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
from typing import Any, Callable, Mapping, Sequence

MAX_SAMPLES = 64  # samples kept by key (PipelineProfile.startup_samples_s)
PROBE_TIMEOUT_S = 600
PHASES = ("encode", "denoise", "decode")
RSS_KEY = "process_rss_bytes"  # probe(): the process's resident set after its calls, not a start-up
COLD_MOST_CACHED = 0.5  # a cold probe whose libraries kept more of their bytes cached is not a fresh machine's


def startup_record(old: Mapping[str, Sequence[float]], new: Mapping[str, Sequence[float]], how: str
                   ) -> tuple[dict[str, float], dict[str, list[float]], Any]:
    """The start-up by key from `old` samples (a profile's) and `new` ones: (startup_s: each key's mean,
    startup_samples_s: the newest MAX_SAMPLES, the `startup` FitQuality: every sample about its key's mean, one
    value fitted a key; None with too few samples)."""
    from chunkflow.commands.calibrate.fit import fit_quality

    samples = {k: [*old.get(k, []), *new.get(k, [])][-MAX_SAMPLES:] for k in {*old, *new}}
    samples = {k: [max(0.0, float(x)) for x in xs] for k, xs in samples.items() if xs}
    means = {k: statistics.fmean(xs) for k, xs in samples.items()}
    own = any(k.startswith("encode:") for k in samples)  # an encode's gap is kept twice: counted under its own key
    priced = {k: xs for k, xs in samples.items()  # a freshly started machine's is a band edge, not a priced figure
              if means[k] > 0 and not (own and k == "encode") and not k.startswith("cold:")}
    residuals = [x / means[k] - 1.0 for k, xs in priced.items() for x in xs]
    q = fit_quality("startup", residuals, f"{how}: each sample about its key's mean", fitted=len(priced))
    return means, samples, q


PROBE = """
import json, sys
from chunkflow.commands.calibrate.startup import probe
print(json.dumps(probe(sys.argv[1], sys.argv[2])))
"""


def _gap(call: Callable[[], Any], sync: Callable[[], None]) -> float:
    """Seconds the first call of `call` takes over its second (at least 0)."""
    import time

    times = []
    for _ in range(2):
        sync()
        t0 = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - t0)
    return max(0.0, times[0] - times[1])


def probe(model: str, device_name: str) -> dict[str, float]:
    """In this process, new: per phase, its components' first call less their second (seconds), as a generation's
    first phases pay: encode (each text encoder at a small width; keyed `encode` and the pipeline's own
    `encode:<archs>`), denoise (the transformer with one block a list at its smallest calibration size), decode
    (the VAE at its smallest calibration size); and under RSS_KEY the process's resident set once those modules are
    freed: what a generation's process holds besides its weights, the libraries its kernels loaded included."""
    import gc

    import torch

    from chunkflow.hostmem import rss_bytes
    from chunkflow_planner.catalog import encode_startup_key, get_model

    spec, device = get_model(model), torch.device(device_name)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    out: dict[str, float] = {}
    with torch.no_grad():
        if spec.pipeline is not None and spec.pipeline.text_encoders:
            out["encode"] = _encode_gap(spec, device, sync)
            if encode_startup_key(spec):
                out[encode_startup_key(spec)] = out["encode"]
        out["denoise"] = _denoise_gap(spec, device, sync)
        if spec.pipeline is not None:
            out["decode"] = _vae_gap(spec, device, sync)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    out[RSS_KEY] = float(rss_bytes())
    return out


def _encode_gap(spec, device, sync: Callable[[], None]) -> float:
    """Each text encoder's first forward less its second, at a small width (random weights)."""
    from chunkflow.commands.calibrate.host import _forward, small_text_encoder

    runs = [_forward(small_text_encoder(te, 2, device), te, device) for te in spec.pipeline.text_encoders]
    return _gap(lambda: [r() for r in runs], sync)


def _denoise_gap(spec, device, sync: Callable[[], None]) -> float:
    """The transformer's first forward less its second, one block a list, at its smallest calibration size."""
    import torch

    from chunkflow.commands.calibrate.points import default_points, one_block_spec
    from chunkflow.models.build import build_transformer
    from chunkflow.models.inputs import make_inputs

    one = one_block_spec(spec)
    model_, handle = build_transformer(one, weights=None, dtype=torch.bfloat16, device=device, config="none")
    inputs = make_inputs(one, default_points(spec, cpu=device.type != "cuda")[0], torch.bfloat16, device, seed=0)
    gap = _gap(lambda: model_(**inputs), sync)
    handle.remove()
    return gap


def _vae_gap(spec, device, sync: Callable[[], None]) -> float:
    """The VAE's first decode less its second, at its smallest calibration size (random weights, its dtype)."""
    import torch

    from chunkflow.api import offload
    from chunkflow.commands.calibrate.ops import vae_points
    from chunkflow.models.components import meta_vae
    from chunkflow.models.meta import RandomSource
    from chunkflow.models.pipeline_build import DTYPES

    vs = spec.pipeline.vae
    vae = meta_vae(vs, DTYPES[vs.dtype])
    handle = offload(vae, "none", device=device, source=RandomSource(0, device, vae))
    b, f, h, w = vae_points(spec, cpu=device.type != "cuda")[0][0]
    s = spec.vae_spatial
    lf = (f - 1) // (spec.vae_temporal or 1) + 1
    shape = (b, spec.latent_channels, h // s, w // s) if vs.cls == "AutoencoderKL" else \
        (b, spec.latent_channels, lf, h // s, w // s)
    z = torch.randn(shape, device=device, dtype=DTYPES[vs.dtype])
    gap = _gap(lambda: vae.decode(z, return_dict=False), sync)
    handle.remove()
    return gap


def measure_startup(model: str, processes: int, device: str, log: Callable[[str], None] = lambda s: None
                    ) -> dict[str, list[float]]:
    """probe() in `processes` new processes, one after another: each key's samples (a process that fails is said
    and left out)."""
    env = dict(os.environ)
    if device == "cpu":
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    samples: dict[str, list[float]] = {}
    for i in range(processes):
        try:
            p = subprocess.run([sys.executable, "-c", PROBE, model, device], capture_output=True, text=True,
                               timeout=PROBE_TIMEOUT_S, env=env)
        except subprocess.TimeoutExpired:
            log(f"start-up probe {i + 1} took over {PROBE_TIMEOUT_S} s: left out")
            continue
        if p.returncode != 0:
            log(f"start-up probe {i + 1} failed: {(p.stderr.strip().splitlines() or ['?'])[-1]}")
            continue
        for key, gap in json.loads(p.stdout.strip().splitlines()[-1]).items():
            samples.setdefault(key, []).append(float(gap))
    return samples


def measure_cold_startup(model: str, device: str, log: Callable[[str], None] = lambda s: None,
                         most_cached: float = COLD_MOST_CACHED) -> dict[str, list[float]]:
    """One cold process as on a freshly started machine: the libraries dropped from the page cache first, then
    probe(); its phases' samples keyed `cold:<phase>`. None where the libraries stayed cached (over `most_cached`
    of their bytes: mapped by this process, or a system that cannot drop them)."""
    from chunkflow.loading.libraries import cached_share, library_files

    still = cached_share(library_files(), drop_first=True)
    if still is None or still > most_cached:
        log("a freshly started machine's start-up not measured: the libraries could not be dropped from the page "
            "cache" + ("" if still is None else f" ({still:.0%} of their bytes stayed)"))
        return {}
    samples = measure_startup(model, 1, device, log)
    log(f"libraries dropped from the page cache ({still:.0%} stayed): a freshly started machine's start-up "
        + ", ".join(f"{k} {v[0]:.3f} s" for k, v in samples.items() if k in PHASES))
    return {f"cold:{k}": v for k, v in samples.items() if k in PHASES}


def _warm_share(found: dict[str, Any], log: Callable[[str], None]) -> None:
    """The libraries' cached share once the probes ran (libraries.warm_share) into `found` as
    `libraries_warm_share`, where the system can tell."""
    from chunkflow.loading.libraries import warm_share

    share = warm_share()
    if share is not None:
        found["libraries_warm_share"] = share
        log(f"the libraries' bytes in the page cache once warm: {share:.0%} (a run under half of that starts cold)")


def calibrated_startup(model: str, processes: int, device: str, log: Callable[[str], None],
                       cold: Mapping[str, Sequence[float]] | None = None
                       ) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """The profile's start-up figures from `processes` cold processes (startup_record) and `cold`, a freshly started
    machine's samples (measure_cold_startup, taken before the parent ran a kernel): {startup_s, startup_samples_s,
    fit: the `startup` FitQuality or None; process_host_bytes: the probes' median resident set, RSS_KEY;
    libraries_warm_share: the libraries' cached share after them}, and the raw samples."""
    raw = {**measure_startup(model, processes, device, log), **(cold or {})}
    samples = {k: v for k, v in raw.items() if k != RSS_KEY}
    if not samples:
        return {}, {}
    how = f"chunkflow calibrate {datetime.date.today()}: {processes} cold process(es) of {model} on {device}"
    means, kept, q = startup_record({}, samples, how)
    log("start-up of a process's first calls over " + f"{processes} cold processes: "
        + ", ".join(f"{k} {v:.3f} s" for k, v in means.items()))
    found = dict(startup_s=means, startup_samples_s=kept, fit=q)
    _warm_share(found, log)
    if raw.get(RSS_KEY):
        found["process_host_bytes"] = int(statistics.median(raw[RSS_KEY]))
        log(f"a process's own host memory after its first calls: {found['process_host_bytes'] / 1e9:.2f} GB "
            f"(median of {len(raw[RSS_KEY])} probe(s), their modules freed)")
    return found, raw
