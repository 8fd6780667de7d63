"""diffusers alone, for comparison with `chunkflow run --weights`: time `Pipeline.from_pretrained(DIR).to(device)`
and the process's host peak, then generate with the call chunkflow makes and compare the latents with chunkflow's.
MODEL is a catalog name or a plan file (its model: the catalog's or the one derived from a folder; its workload:
the plan's, each flag given replacing its field); `--image PATH`
animates or edits that image with the class chunkflow runs (WanPipeline's folder as WanImageToVideoPipeline). The
latents compared are the denoising loop's last (what `run --latents` saves). With `--disk-offload TMP`, diffusers'
own disk offload instead of `.to(device)`: the transformer(s) and text encoder
group-offloaded block by block with streams and `offload_to_disk_path=TMP`, the VAE on the GPU (tiled with --tiled);
the generation then decodes too, as `chunkflow run --prompt` does. With `--group-offload`, diffusers' block-level
group offloading of the transformer(s) in host memory (streams, one block a group), the rest on the GPU. With
`--cache SPEC` (as `chunkflow run --cache` takes it), the same diffusers step cache enabled on the transformer(s)
(chunkflow.caches.diffusers_config: the very config chunkflow's run makes).

    python3 scripts/diffusers_load.py wan2.2 DIR --frames 41 --height 480 --width 832 --steps 4 --prompt "..." \
        [--negative-prompt ...] [--guidance 5] [--seed 0] [--latents chunkflow-latents.safetensors] --out r.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    import diffusers

    from chunkflow.generate import call_kwargs
    from chunkflow.hostmem import peak_rss_bytes
    from chunkflow.models.adapters import run_class
    from chunkflow_planner.catalog import get_model
    from chunkflow_planner.plan import load_plan, model_of
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("folder")
    for k in ("frames", "height", "width", "steps", "batch"):
        ap.add_argument(f"--{k}", type=int, default=None)
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--negative-prompt", default=None)
    ap.add_argument("--guidance", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--latents", default=None, help="chunkflow's latents (run --latents) to compare with")
    ap.add_argument("--image", default=None, help="the image to animate or edit (as run --image)")
    ap.add_argument("--disk-offload", default=None, help="diffusers' group offloading to this folder on disk")
    ap.add_argument("--tiled", action="store_true", help="with --disk-offload: tiled VAE decode")
    ap.add_argument("--group-offload", action="store_true", help="diffusers' block-level group offloading in host "
                    "memory of the transformer(s), with streams")
    ap.add_argument("--cache", default=None, help="a step cache, as chunkflow run --cache takes it")
    ap.add_argument("--drop-folder-after-load", action="store_true",
                    help="delete the folder's weight files once loaded (room on a small disk for diffusers' own)")
    ap.add_argument("--warmup", type=int, default=0, help="generations run (same seed) before the timed one, as "
                    "chunkflow run --warmup")
    ap.add_argument("--device", default="cuda", help="cuda (cpu: a check of this script on tiny folders)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    cuda = a.device == "cuda"
    plan = load_plan(a.model) if a.model.endswith(".json") else None
    spec = model_of(plan) if plan else get_model(a.model)
    w = _workload(spec, plan, a)
    dtypes = {"default": torch.bfloat16, "vae": getattr(torch, spec.pipeline.vae.dtype)}
    cls = run_class(spec.pipeline.cls, None, a.image is not None, spec=spec) if a.image else \
        getattr(diffusers, spec.pipeline.cls)
    t0 = time.perf_counter()
    pipe = cls.from_pretrained(a.folder, torch_dtype=dtypes)
    t1 = time.perf_counter()
    if a.drop_folder_after_load:
        import pathlib

        for f in pathlib.Path(a.folder).glob("*/*.safetensors"):
            f.unlink()
    if a.disk_offload:
        _disk_offload(pipe, spec, a.disk_offload, a.tiled)
    elif a.group_offload:
        _group_offload(pipe, a.device)
    else:
        pipe.to(a.device)
    if a.cache:
        _enable_cache(pipe, a.cache, w.steps)
    if cuda:
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    host_after_load = peak_rss_bytes()
    pipe.set_progress_bar_config(disable=True)
    image = None
    if a.image:
        from PIL import Image

        image = Image.open(a.image).convert("RGB")
    kw = call_kwargs(spec, w, a.prompt, a.negative_prompt, a.guidance, w.steps,
                     torch.Generator(a.device).manual_seed(a.seed), cls, image)
    kw["output_type"] = "np" if a.disk_offload else "latent"
    kw["callback_on_step_end"] = _keep_latents  # the loop's last latents, as chunkflow saves them
    kw["callback_on_step_end_tensor_inputs"] = ["latents"]
    for _ in range(a.warmup):  # the pipeline resets a cache's state when its call ends
        kw["generator"] = torch.Generator(a.device).manual_seed(a.seed)
        with torch.no_grad():
            pipe(**kw)
    kw["generator"] = torch.Generator(a.device).manual_seed(a.seed)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t3 = time.perf_counter()
    with torch.no_grad():
        pipe(**kw)
    if cuda:
        torch.cuda.synchronize()
    latents = _kept["latents"]
    result = dict(model=spec.name, pipeline=cls.__name__, folder=a.folder, from_pretrained_s=t1 - t0, to_device_s=t2 - t1,
                  load_s=t2 - t0, host_peak_after_load_bytes=host_after_load, generation_s=time.perf_counter() - t3,
                  host_peak_bytes=peak_rss_bytes(), date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                  diffusers=diffusers.__version__, torch=torch.__version__,
                  gpu=torch.cuda.get_device_name() if cuda else None,
                  gpu_peak_reserved_bytes=torch.cuda.max_memory_reserved() if cuda else None, host_now_bytes=_rss_now(),
                  disk_offload=a.disk_offload, group_offload=a.group_offload, cache=a.cache,
                  warmup=a.warmup)
    if a.latents:
        from safetensors.torch import load_file

        ours = load_file(a.latents)["latents"]
        ref = latents.detach().cpu()
        result["latents_identical"] = bool(ours.dtype == ref.dtype and ours.shape == ref.shape and torch.equal(ours, ref))
        result["latents_max_abs_diff"] = float((ours.float() - ref.float()).abs().max()) if ours.shape == ref.shape \
            else None
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


def _workload(spec, plan, a):
    """The generation's workload: a plan's own (its shape and steps, as `chunkflow run --plan` makes it), else the
    model's defaults, with the flags given replacing either. A plan's shape is never left to the catalog's defaults:
    Wan2.2's are 121 frames where a plan may say 81, and the latents compared would then differ in shape."""
    from chunkflow_planner.workload import make_workload

    base = plan.workload.to_workload() if plan else None
    given = {k: getattr(a, k) for k in ("batch", "frames", "height", "width", "steps")}
    fields = {k: v if v is not None or base is None else getattr(base, k) for k, v in given.items()}
    return make_workload(spec, **fields)


_kept: dict = {}


def _keep_latents(pipe, i, t, kw):
    _kept["latents"] = kw["latents"]
    return kw


def _rss_now() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _group_offload(pipe, device: str) -> None:
    """diffusers' block-level group offloading of the transformer(s) from host memory (streams where on a GPU), the
    other components on the device."""
    from diffusers.hooks import apply_group_offloading

    dev = torch.device(device)
    for name, component in pipe.components.items():
        if not isinstance(component, torch.nn.Module):
            continue
        if name in ("transformer", "transformer_2"):
            apply_group_offloading(component, onload_device=dev, offload_device=torch.device("cpu"),
                                   offload_type="block_level", num_blocks_per_group=1, use_stream=dev.type == "cuda")
        else:
            component.to(dev)


def _enable_cache(pipe, spec_text: str, steps: int) -> None:
    """The step cache `spec_text` on the pipeline's transformer(s), as chunkflow's run enables it."""
    from chunkflow.caches import diffusers_config
    from chunkflow_planner.cache import parse_cache

    setting = parse_cache(spec_text)
    for name in ("transformer", "transformer_2"):
        module = getattr(pipe, name, None)
        if module is not None:
            module.enable_cache(diffusers_config(setting, steps))


def _disk_offload(pipe, spec, folder: str, tiled: bool) -> None:
    """diffusers' best disk offload: block-level group offloading with streams, each group's weights on disk."""
    from diffusers.hooks import apply_group_offloading

    dev = torch.device("cuda")
    names = [n for n in ("transformer", "transformer_2") if getattr(pipe, n, None) is not None]
    names += [te.component for te in spec.pipeline.text_encoders]
    for name in names:
        apply_group_offloading(getattr(pipe, name), onload_device=dev, offload_device=torch.device("cpu"),
                               offload_type="block_level", num_blocks_per_group=1, use_stream=True,
                               offload_to_disk_path=f"{folder}/{name}")
    pipe.vae.to(dev)
    if tiled:
        pipe.vae.enable_tiling()


if __name__ == "__main__":
    main()
