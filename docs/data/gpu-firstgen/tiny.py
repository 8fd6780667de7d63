"""The evidence script's CPU dry run (TINY=1): the held-out pipelines tiny (the same classes; a few channels), as the
tests build them (PixArt-Sigma, SD3) or here (Mochi: its VAE's latent statistics fix 12 latent channels), saved as
diffusers folders with save_pretrained.

    python3 docs/data/gpu-firstgen/tiny.py NAME FOLDER      (NAME: pixart-sigma, sd3-medium or mochi)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))

from test_pipelines_53 import _pixart  # noqa: E402
from test_run_any import _save, _sd3, _seeded, _t5  # noqa: E402

from chunkflow.models.tokenizers import t5_tokenizer  # noqa: E402


def _mochi(folder: Path) -> Path:
    """Mochi with 12 latent channels (its VAE's latents_mean and latents_std have 12) and a 32-channel VAE."""
    from diffusers import AutoencoderKLMochi, FlowMatchEulerDiscreteScheduler, MochiPipeline, MochiTransformer3DModel

    transformer = _seeded(1, lambda: MochiTransformer3DModel(
        patch_size=2, num_attention_heads=2, attention_head_dim=8, num_layers=2, pooled_projection_dim=16,
        in_channels=12, text_embed_dim=16, time_embed_dim=8, max_sequence_length=16))
    vae = _seeded(2, lambda: AutoencoderKLMochi(encoder_block_out_channels=(32,) * 4,
                                                decoder_block_out_channels=(32,) * 4, layers_per_block=(1,) * 5))
    tok = t5_tokenizer()
    pipe = MochiPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, tokenizer=tok, transformer=transformer,
                         text_encoder=_t5(tok, 1, d_model=16, t5_class="T5EncoderModel"))
    return _save(pipe, folder, vae=torch.bfloat16)  # the pipeline decodes its bf16 latents as they are


BUILDERS = {"pixart-sigma": _pixart, "sd3-medium": lambda folder: _sd3(folder)[0] and folder, "mochi": _mochi}

if __name__ == "__main__":
    name, folder = sys.argv[1], Path(sys.argv[2])
    folder.parent.mkdir(parents=True, exist_ok=True)
    BUILDERS[name](folder)
    print(f"{name}: saved (tiny) to {folder}")
