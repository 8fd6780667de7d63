"""One way of generating, in a process of its own, for issue 39's comparison (docs/codec-h200.md): a warm-up
generation (another prompt, so that the timed one runs its text encoder too), then the timed one, whole (decoded);
its time, peaks and last latents written out.

    python3 scripts/codec_compare.py chunkflow PLAN.json DIR --prompt "..." --out r.json [--latents l.safetensors]
    python3 scripts/codec_compare.py leaf      PLAN.json DIR --prompt "..." --out r.json    # diffusers, leaf-level
    python3 scripts/codec_compare.py gpu       PLAN.json DIR --prompt "..." --out r.json    # diffusers, all on GPU

chunkflow: `chunkflow.load(plan, weights=DIR)` and `Session.generate` (the plan's offload, codec or not). leaf:
diffusers' own group offloading at leaf level with streams on the transformer and the text encoders, the VAE on the
GPU. gpu: `pipe.to("cuda")`. The diffusers ways make the call chunkflow makes (chunkflow.generate.call_kwargs) for
the plan's shape and steps. `--compare` a latents file: whether these latents equal it bit for bit.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

WARM_PROMPT = "a warm-up prompt, not timed"


def _chunkflow(a, plan, spec, w) -> tuple[float, torch.Tensor, dict]:
    import chunkflow

    t0 = time.perf_counter()
    session = chunkflow.load(a.plan, weights=a.folder)
    load_s = time.perf_counter() - t0
    session.generate(WARM_PROMPT, seed=a.seed)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    r = session.generate(a.prompt, seed=a.seed)
    stats = {name: h.stats().as_dict() for name, h in session.built.handles.items()}
    extra = dict(load_s=load_s, predicted_s=r.predicted_s, step_times_s=r.step_times_s, handles=stats,
                 h2d_bytes_per_step=None)
    tr = stats.get("transformer")
    if tr:
        extra["h2d_bytes_per_step"] = (tr["codec_stored_bytes"] + tr["streamed_bytes_per_step"]
                                       - tr["codec_raw_bytes"])
        extra["codec_stats"] = {k: v for k, v in tr.items() if k.startswith("codec")}
    return r.seconds, r.latents, extra


_kept: dict = {}


def _keep_latents(pipe, i, t, kw):
    _kept["latents"] = kw["latents"]
    return kw


def _diffusers(a, plan, spec, w) -> tuple[float, torch.Tensor, dict]:
    import diffusers
    from diffusers.hooks import apply_group_offloading

    from chunkflow.generate import call_kwargs

    cls = getattr(diffusers, spec.pipeline.cls)
    t0 = time.perf_counter()
    pipe = cls.from_pretrained(a.folder, torch_dtype={"default": torch.bfloat16,
                                                      "vae": getattr(torch, spec.pipeline.vae.dtype)})
    dev = torch.device("cuda")
    if a.way == "leaf":
        names = [n for n in ("transformer", "transformer_2") if getattr(pipe, n, None) is not None]
        names += [te.component for te in spec.pipeline.text_encoders]
        for name in names:
            apply_group_offloading(getattr(pipe, name), onload_device=dev, offload_device=torch.device("cpu"),
                                   offload_type="leaf_level", use_stream=True)
        pipe.vae.to(dev)
    else:
        pipe.to(dev)
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    pipe.set_progress_bar_config(disable=True)

    def call(prompt):
        kw = call_kwargs(spec, w, prompt, None, None, w.steps, torch.Generator("cuda").manual_seed(a.seed), cls, None)
        kw["callback_on_step_end"] = _keep_latents
        kw["callback_on_step_end_tensor_inputs"] = ["latents"]
        t = time.perf_counter()
        with torch.no_grad():
            pipe(**kw)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    call(WARM_PROMPT)
    torch.cuda.reset_peak_memory_stats()
    seconds = call(a.prompt)
    return seconds, _kept["latents"].detach().cpu(), dict(load_s=load_s, diffusers=diffusers.__version__)


def main() -> None:
    from chunkflow.hostmem import peak_rss_bytes
    from chunkflow_planner.plan import load_plan, model_of
    from chunkflow_planner.workload import make_workload

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("way", choices=["chunkflow", "leaf", "gpu"])
    ap.add_argument("plan")
    ap.add_argument("folder")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--latents", default=None, help="write these latents here")
    ap.add_argument("--compare", default=None, help="a latents file to compare with, bit for bit")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    plan = load_plan(a.plan)
    spec = model_of(plan)
    wl = plan.workload
    w = make_workload(spec, batch=wl.batch, frames=wl.frames, height=wl.height, width=wl.width, steps=wl.steps)
    fn = _chunkflow if a.way == "chunkflow" else _diffusers
    seconds, latents, extra = fn(a, plan, spec, w)
    result = dict(way=a.way, model=spec.name, plan=a.plan, codec=plan.offload.codec if a.way == "chunkflow" else None,
                  generation_s=seconds, host_peak_bytes=peak_rss_bytes(), torch=torch.__version__,
                  date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), **extra)
    if torch.cuda.is_available():
        result.update(gpu=torch.cuda.get_device_name(), gpu_peak_allocated_bytes=torch.cuda.max_memory_allocated(),
                      gpu_peak_reserved_bytes=torch.cuda.max_memory_reserved())
    latents = latents.detach().cpu()
    if a.latents:
        from safetensors.torch import save_file

        save_file({"latents": latents.contiguous()}, a.latents)
    if a.compare:
        from safetensors.torch import load_file

        ref = load_file(a.compare)["latents"]
        result["latents_identical"] = bool(ref.shape == latents.shape and ref.dtype == latents.dtype
                                           and torch.equal(ref, latents))
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2, default=str)
    print(json.dumps({k: v for k, v in result.items() if k != "handles"}, indent=2, default=str))


if __name__ == "__main__":
    main()
