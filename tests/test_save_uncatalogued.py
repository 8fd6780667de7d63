"""scripts/save_uncatalogued.py --share-with: files another saved folder holds byte for byte are hard-linked (the
first-generation evidence saves three T5-XXL encoders that are the same bytes), and nothing else is."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import save_uncatalogued as su  # noqa: E402


def _tiny_t5(seed: int):
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    return T5EncoderModel(T5Config(d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2, vocab_size=100))


def test_same_bytes_are_linked_under_another_subfolder_and_others_are_not(tmp_path):
    first, second = tmp_path / "pixart", tmp_path / "sd3"
    _tiny_t5(0).save_pretrained(first / "text_encoder")
    _tiny_t5(0).save_pretrained(second / "text_encoder_3")  # SD3 keeps its T5 under another name
    _tiny_t5(1).save_pretrained(second / "text_encoder")  # same file names, other values
    freed = su.share_with(second, first)
    a, b = first / "text_encoder" / "model.safetensors", second / "text_encoder_3" / "model.safetensors"
    assert a.samefile(b) and freed >= b.stat().st_size
    assert not (second / "text_encoder" / "model.safetensors").samefile(a)
    from transformers import T5EncoderModel
    back = T5EncoderModel.from_pretrained(second / "text_encoder_3")
    assert all(torch.equal(p, q) for p, q in zip(back.state_dict().values(), _tiny_t5(0).state_dict().values()))
    assert su.share_with(second, first) == 0  # linked already: nothing more
    assert not list(second.rglob("*.link"))
