"""Attention priced at each model's head dim (issue 37): the profile's attention table is measured at head dim 128;
calibrate measures 64 too (attn_eta_head_dims), and an attention of head dim 64 (LTX-Video, CogVideoX) is priced with
that table: on an H200 it ran at 0.69x of head dim 128's rate at CogVideoX's shape, and CogVideoX-5B stepped 23%
slower than planned without it (docs/data/h200-any/replan.txt)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from chunkflow_planner.catalog import get_hardware
from chunkflow_planner.ops import Attention, eta_attn, op_time

TABLE_128 = [(1024.0, 1024.0, 0.4), (1024.0, 16384.0, 0.6), (16384.0, 1024.0, 0.6), (16384.0, 16384.0, 0.7)]
TABLE_64 = [(q, kv, e * 0.7) for q, kv, e in TABLE_128]


def _hw(**update):
    return get_hardware("h200").model_copy(update={"attn_eta": TABLE_128, **update})


def test_an_attention_takes_the_table_of_its_head_dim():
    hw = _hw(attn_eta_head_dims={64: TABLE_64})
    assert eta_attn(hw, 16384, 16384, hd=128) == pytest.approx(0.7)
    assert eta_attn(hw, 16384, 16384, hd=64) == pytest.approx(0.49)
    assert eta_attn(hw, 16384, 16384, hd=80) == pytest.approx(0.49)  # nearer 64 than 128 (log scale)
    assert eta_attn(hw, 16384, 16384, hd=256) == pytest.approx(0.7)
    slow, fast = (op_time(Attention(1, 48, 17776, 17776, hd), hw) for hd in (64, 128))
    assert slow / fast == pytest.approx(0.7 / 0.49 / 2, rel=1e-6)  # half the FLOPs at 0.7x the rate


def test_without_a_table_for_it_the_head_dim_128_table_prices_it():
    hw = _hw()
    assert eta_attn(hw, 16384, 16384, hd=64) == eta_attn(hw, 16384, 16384, hd=128) == pytest.approx(0.7)


def test_a_masked_attention_keeps_the_masked_table():
    hw = _hw(attn_eta_head_dims={64: TABLE_64}, attn_eta_masked=[(q, kv, 0.1) for q, kv, _ in TABLE_128])
    assert eta_attn(hw, 16384, 16384, masked=True, hd=64) == pytest.approx(0.1)


@pytest.mark.parametrize("tables", [{4: TABLE_64}, {64: [(1024.0, 1024.0, 1.5)]}, {64: []}])
def test_a_profile_with_a_bad_head_dim_table_is_refused(tables):
    with pytest.raises(ValidationError):
        type(_hw()).model_validate({**_hw().model_dump(), "attn_eta_head_dims": tables})
