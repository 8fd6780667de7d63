"""HunyuanVideo under Ulysses: the context-parallel plan diffusers 0.42.1 lacks, and an attention processor.

HunyuanVideo's attention processor already goes through `dispatch_attention_fn(parallel_config=...)`, so a
`_cp_plan` of our own (`cp_plan()`) is enough to use diffusers' Ulysses all-to-all. One thing the plan cannot
express is its attention mask: the model builds a `[B, 1, 1, S_img + S_txt]` mask over the *full* joint sequence,
while after the all-to-all each rank holds the keys in the order `[img_0, txt_0, img_1, txt_1, ...]` (every rank
concatenates its own image and text shards). `HunyuanVideoUlyssesProcessor` (a subclass of diffusers' processor)
permutes the mask into that order and leaves everything else to diffusers. The text length must be divisible by
the degree (256 for HunyuanVideo: fine for 2, 4, 8).
"""

from __future__ import annotations

import torch


def cp_plan() -> dict:
    """The `_cp_plan` for HunyuanVideoTransformer3DModel: split rope and the first block's inputs, gather proj_out."""
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    return {
        "rope": {  # (freqs_cos, freqs_sin), one row per image token
            0: ContextParallelInput(split_dim=0, expected_dims=2, split_output=True),
            1: ContextParallelInput(split_dim=0, expected_dims=2, split_output=True),
        },
        "transformer_blocks.0": {
            "hidden_states": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False),
            "encoder_hidden_states": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False),
        },
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }


def permute_joint_mask(mask: torch.Tensor, img_local: int, txt_local: int, degree: int) -> torch.Tensor:
    """Full `[..., P*img + P*txt]` key mask -> the order `[img_0, txt_0, img_1, txt_1, ...]` (P = degree)."""
    n_img = img_local * degree
    if mask.shape[-1] != n_img + txt_local * degree:
        return mask  # already local or of another layout: leave it to diffusers
    img, txt = mask[..., :n_img], mask[..., n_img:]
    parts = []
    for r in range(degree):
        parts += [img[..., r * img_local:(r + 1) * img_local], txt[..., r * txt_local:(r + 1) * txt_local]]
    return torch.cat(parts, dim=-1)


def processor_class():
    """HunyuanVideoUlyssesProcessor: diffusers' processor, with the full-sequence mask permuted to the
    post-all-to-all key order. Built on first use (diffusers is imported then)."""
    from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoAttnProcessor2_0

    global _PROCESSOR
    if _PROCESSOR is None:
        class HunyuanVideoUlyssesProcessor(HunyuanVideoAttnProcessor2_0):
            def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                         image_rotary_emb=None):
                cp = self._parallel_config.context_parallel_config if self._parallel_config else None
                if attention_mask is not None and cp is not None and encoder_hidden_states is not None:
                    attention_mask = permute_joint_mask(attention_mask, hidden_states.shape[1],
                                                        encoder_hidden_states.shape[1], cp.ulysses_degree)
                return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)

        _PROCESSOR = HunyuanVideoUlyssesProcessor
    return _PROCESSOR


_PROCESSOR = None
