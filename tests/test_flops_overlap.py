"""Formulas against hand calculations (paper Appendix B) and the overlap model (section 3.1)."""

import pytest

from chunkflow_planner.catalog import get_hardware, get_model
from chunkflow_planner.flops import F_block_avg, F_block_per_gpu, F_dbl, F_dit, F_sng
from chunkflow_planner.overlap import F_star, I_star, T_comp, T_pref, analyse, critical_point
from chunkflow_planner.workload import WorkloadError, make_workload, tokens


def test_F_dit_by_hand():
    # B=1, S=10, L=2, d=4, f=8: 8BSd^2=1280, 4BS^2d=1600, 4BSd^2+4BLd^2=640+128, 4BSLd=320, 4BSdf=1280
    assert F_dit(1, 10, 2, 4, 8) == 1280 + 1600 + 768 + 320 + 1280
    assert F_dit(3, 10, 2, 4, 8) == 3 * F_dit(1, 10, 2, 4, 8)


def test_F_dbl_by_hand():
    # 8BSd^2=1280, 8BLd^2=256, 4B(S+L)^2 d=2304, 4BSdf=1280, 4BLdf=256
    assert F_dbl(1, 10, 2, 4, 8) == 1280 + 256 + 2304 + 1280 + 256


def test_F_sng_by_hand():
    # T=12: 2BTd(3d+f)=1920, 4BT^2 d=2304, 2BT(d+f)d=1152
    assert F_sng(1, 10, 2, 4, 8) == 1920 + 2304 + 1152


def test_block_average_weights_counts():
    flux = get_model("flux")
    S, L, d, f = 4096, flux.text_len, flux.d, flux.f
    expected = (19 * F_dbl(1, S, L, d, f) + 38 * F_sng(1, S, L, d, f)) / 57
    assert F_block_avg(flux, 1, S) == pytest.approx(expected, rel=1e-12)
    assert F_block_per_gpu(flux, 1, S, sp=2) == pytest.approx(expected / 2, rel=1e-12)


def test_tokens_match_paper_table_2():
    wan, hy, flux = get_model("wan2.2"), get_model("hunyuan"), get_model("flux")
    for n in (41, 81, 121, 161):
        assert tokens(wan, make_workload(wan, frames=n)) == 220 * (n + 3)
    for n in (9, 21, 33, 45):
        assert tokens(hy, make_workload(hy, frames=n, height=720, width=1280)) == 900 * (n + 3)
    assert tokens(flux, make_workload(flux, batch=4)) == 4096


def test_frames_validation_names_nearest_valid():
    wan = get_model("wan2.2")
    with pytest.raises(WorkloadError, match=r"77 or 81"):
        make_workload(wan, frames=80)
    with pytest.raises(WorkloadError, match="image model"):
        make_workload(get_model("flux"), frames=5)
    with pytest.raises(WorkloadError, match="divisible by 32"):
        make_workload(wan, height=700)


def test_time_and_critical_formulas_by_hand():
    P, BW = 756e12, 31.5e9
    assert T_comp(1.2e12, P, 0.6) == pytest.approx(1.2e12 / (0.6 * 756e12))
    assert T_pref(520e6, BW, 0.89) == pytest.approx(520e6 / (0.89 * 31.5e9))
    fs = F_star(P, 0.6, 520e6, BW, 0.89)
    assert fs == pytest.approx(0.6 * 756e12 * 520e6 / (0.89 * 31.5e9))
    assert I_star(P, 0.6, BW, 0.89) == pytest.approx(fs / 520e6)


def test_critical_point_is_where_flops_meet_f_star():
    wan, hw = get_model("wan2.2"), get_hardware("h100-pcie-x2-paper")
    w = make_workload(wan, frames=81)
    a = analyse(wan, w, hw, sp=2, prefetch_bytes=520e6)
    n = a.critical.value
    S = 220 * (n + 3)
    assert F_block_per_gpu(wan, 1, S, sp=2) == pytest.approx(a.F_star, rel=1e-9)
    assert a.regime == "exposed" and a.F_block < a.F_star
    assert analyse(wan, make_workload(wan, frames=161), hw, sp=2, prefetch_bytes=520e6).regime == "hidden"


def test_critical_never_and_always():
    wan = get_model("wan2.2")
    w = make_workload(wan, frames=81)
    never = critical_point(wan, w, f_star=1e30, sp=2)
    assert never.value is None and never.reason.startswith("never")
    always = critical_point(wan, w, f_star=1.0, sp=1)
    assert always.value is None and always.nearest_valid == 1
