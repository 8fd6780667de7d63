"""The decode phase's pricing: the VAE's measured decode fit (catalog.VaeDecodeFit: the profile's, else the
catalog's), tiled or not, and the pipeline's postprocessing of the output on the host."""

from __future__ import annotations

from chunkflow_planner.catalog import HardwareSpec, ModelSpec, VaeDecodeFit, Workload
from chunkflow_planner.overlap import GB
from chunkflow_planner.pipeline.placement import PipelineError

# The decoded frames in host memory at the end of a generation, as float32 RGB: diffusers' postprocessing holds
# two copies (the tensor brought to the CPU and the stacked numpy array) and writing the file a third (its
# conversion). On the 61 generation reports of H200s in docs/data, with process_host_bytes refit for each, the peak
# host memory is predicted within 5.9% (worst) with three copies, within 16.2% with one
# (docs/data/host-model-2026-12-02).
OUTPUT_HOST_COPIES = 3


def output_host_bytes(w: Workload) -> float:
    """Host bytes of the decoded output at the end of a generation (OUTPUT_HOST_COPIES float32 RGB copies)."""
    return OUTPUT_HOST_COPIES * w.batch * w.frames * w.height * w.width * 3 * 4


def vae_fit(spec: ModelSpec, hw: HardwareSpec) -> VaeDecodeFit:
    """The VAE's decode fit measured on this GPU (profile), else the catalog's (measured on the GPU it names)."""
    vae = spec.pipeline.vae
    if vae.name in hw.pipeline.vae_decode:
        return hw.pipeline.vae_decode[vae.name]
    if vae.decode is None:
        raise PipelineError(f"{spec.name}'s VAE {vae.name} has no decode measurement; run `chunkflow calibrate` on a "
                            "GPU to measure it")
    return VaeDecodeFit(**vae.decode)


def output_bytes(w: Workload) -> float:
    """The decoded output as float32 RGB: what the pipeline's postprocessing turns into the result."""
    return w.batch * w.frames * w.height * w.width * 3 * 4


def decode_calls(spec: ModelSpec, w: Workload) -> int:
    """Work units of a tiled decode of `w`'s output: diffusers' decoder calls times the batch (each call decodes the
    batch's tiles together; the fits are measured at batch 1 and priced per tile decoded). 0 where the catalog has
    no tiling for the VAE."""
    tiling = spec.pipeline.vae.tiling
    if tiling is None:
        return 0
    vt = spec.vae_temporal
    lf = (w.frames - 1) // vt + 1 if vt else 1
    return w.batch * tiling.decoder_calls(w.height, w.width, lf, spec.vae_spatial, vt)


def decode_fit(spec: ModelSpec, hw: HardwareSpec, tiled: bool) -> VaeDecodeFit:
    """The fit a decode is priced with: the VAE's (vae_fit), or its tiled one."""
    fit = vae_fit(spec, hw)
    if tiled:
        if fit.tiled is None:
            raise PipelineError(f"the decode fit of {spec.pipeline.vae.name} has no tiled measurement")
        fit = fit.tiled
    return fit


def decode_slack(spec: ModelSpec, hw: HardwareSpec, tiled: bool) -> float | None:
    """The allocator's slack measured with the decode's fit (VaeDecodeFit.alloc_slack); None where it was not."""
    return decode_fit(spec, hw, tiled).alloc_slack


def decode_cost(spec: ModelSpec, w: Workload, hw: HardwareSpec, tiled: bool) -> tuple[float, float]:
    """(seconds, peak activation bytes) of decoding `w`'s output, from the VAE's fit (tiled or not), and of the
    pipeline's postprocessing of it (output_bytes at postprocess_gbps)."""
    fit = decode_fit(spec, hw, tiled)
    calls = decode_calls(spec, w) if fit.time_per_call > 0 else 0
    if fit.time_per_call > 0 and not calls:
        raise PipelineError(f"the decode fit of {spec.pipeline.vae.name} is per decoder call, but the catalog has "
                            "no tiling for it to count them (models.yaml: pipeline.vae.tiling)")
    px = w.height * w.width
    voxels = w.batch * w.frames * px
    mem = fit.mem_const + fit.mem_per_px * px + fit.mem_per_voxel * voxels
    post = output_bytes(w) / (hw.pipeline.postprocess_gbps * GB)
    # a negative intercept (a fit of older calibrations) is not subtracted: small decodes would cost nothing
    seconds = max(0.0, fit.time_const) + fit.time_per_voxel * voxels + fit.time_per_call * calls
    return seconds + post, max(0.0, mem)
