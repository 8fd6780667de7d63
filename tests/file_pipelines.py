"""Pipeline folders and their transformers as single files, for the `--transformer FILE` tests: a tiny
Wan2.2-A14B-style pipeline (WanPipeline with `transformer` and `transformer_2`, boundary_ratio) saved with
save_pretrained, each expert written as a GGUF file (the `gguf` package, Wan's own names, as city96's files) or an
fp8-scaled file (ComfyUI's layout), and diffusers' own pipeline on the same files: the GGUF ones loaded by
`from_single_file(..., GGUFQuantizationConfig)`, the fp8-scaled ones as the plain torch reference of their
dequantization (`w.to(bf16) * scale.to(bf16)`)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from gguf_files import Q, wan_original_name, write_gguf
from pipelines import one_thread

FORMATS = ("gguf", "fp8-scaled")


def two_expert_folder(folder: Path, seed: int = 3) -> Path:
    """The tiny Wan pipeline made as Wan2.2-A14B is (test_disk_components.two_experts), saved with save_pretrained;
    each expert has its own random weights."""
    from chunkflow_planner.catalog import get_model
    from test_disk_components import save, two_experts

    with one_thread():
        return save(two_experts(get_model("tiny")), folder, seed)


def expert_file(folder: Path, name: str, fmt: str, out: Path):
    """The folder's `name` transformer written to `out` in format `fmt`; returns (path, the reference module
    diffusers runs for that file)."""
    import diffusers

    if fmt == "gguf":
        sd = load_file(folder / name / "diffusion_pytorch_model.safetensors")
        path = write_gguf(out.with_suffix(".gguf"), {wan_original_name(k): v for k, v in sd.items()}, Q.Q8_0, "wan")
        gguf = diffusers.GGUFQuantizationConfig(compute_dtype=torch.bfloat16)
        return path, diffusers.WanTransformer3DModel.from_single_file(
            str(path), quantization_config=gguf, config=str(folder), subfolder=name, torch_dtype=torch.bfloat16).eval()
    from test_fp8_scaled import reference, wan_groups, wan_name, write_file

    m = diffusers.WanTransformer3DModel.from_pretrained(folder / name, torch_dtype=torch.bfloat16)
    linear = {n for n, mod in m.named_modules() if isinstance(mod, torch.nn.Linear)}
    other = {k: wan_name(k) for k in m.state_dict() if k.rsplit(".", 1)[0] not in linear}
    path = out.with_suffix(".safetensors")
    return path, reference(m, write_file(path, m, wan_groups(m), other)).eval()


def reference_latents(spec, folder: Path, transformers: dict, prompt: str, negative: str | None, seed: int,
                      w) -> torch.Tensor:
    """diffusers alone: the pipeline from `folder` with `transformers` (name -> module) in place of its own, called
    as chunkflow calls it for workload `w` (guidance_scale_2 for the second expert), its latents."""
    import diffusers

    dtypes = {"default": torch.bfloat16, "vae": getattr(torch, spec.pipeline.vae.dtype)}
    pipe = diffusers.WanPipeline.from_pretrained(folder, torch_dtype=dtypes, **transformers)
    pipe.set_progress_bar_config(disable=True)
    kw = dict(prompt=prompt, negative_prompt=negative, height=w.height, width=w.width, num_frames=w.frames,
              num_inference_steps=w.steps, guidance_scale=spec.pipeline.guidance,
              max_sequence_length=spec.pipeline.text_encoders[0].tokens,
              generator=torch.Generator("cpu").manual_seed(seed), output_type="latent")
    if spec.pipeline.guidance_2 is not None:
        kw["guidance_scale_2"] = spec.pipeline.guidance_2
    with torch.no_grad(), one_thread():
        return pipe(**kw).frames
