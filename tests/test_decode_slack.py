"""The allocator's slack of a VAE decode, measured by calibrate with the decode's fit (VaeDecodeFit.alloc_slack) and
priced in the decode phase's peak in place of the profile's one figure (issue 55: round 4's decode peaks came in 14%
under a plan that held the H200's prior slack, 0.365, where the H100's decodes held about 0.2)."""

from __future__ import annotations

import pytest

from chunkflow.commands.calibrate.ops import SLACK_MOST, fit_vae, vae_slack
from chunkflow_planner.catalog import HardwareSpec, VaeDecodeFit, get_hardware, get_model
from chunkflow_planner.memory import device_need
from chunkflow_planner.pipeline import Placements, estimate, transformer_candidates
from chunkflow_planner.pipeline.decode import vae_fit
from chunkflow_planner.policy import Problem
from chunkflow_planner.workload import make_workload

H200 = get_hardware("h200")


def _rows(slacks, reserved=True):
    """Decodes of 1 GB + 40 B/voxel whose allocator reserved `slack` more than their peak allocation each."""
    rows = []
    for i, s in enumerate(slacks):
        h, w = 256 * (i + 1), 256 * (i + 2)
        peak = 1e9 + 40 * h * w
        rows.append(dict(batch=1, frames=1, height=h, width=w, time_s=0.01 + 1e-9 * h * w, peak_bytes=int(peak),
                         reserved_bytes=int(peak * (1 + s)) if reserved else None))
    return rows


def test_the_slack_is_the_median_of_each_decodes_reserved_beyond_its_peak():
    assert vae_slack(_rows([0.1, 0.2, 0.9])) == pytest.approx(0.2, rel=1e-6)  # one stray decode does not move it
    assert vae_slack(_rows([0.3, 0.5])) == pytest.approx(0.4, rel=1e-6)
    assert vae_slack(_rows([-0.2, -0.1, 0.0])) == 0.0  # expandable segments can reserve less than a peak: not < 0
    assert vae_slack(_rows([-1.0, -1.0])) == 0.0  # measured on CUDA, nothing new reserved (reused segments): 0
    assert vae_slack(_rows([14.0, 15.0, 16.0])) == SLACK_MOST  # a pathological decode: priced at the fit's bound,
    assert VaeDecodeFit(**fit_vae(_rows([14.0, 15.0, 16.0]), False, "t")).alloc_slack == SLACK_MOST  # not refused
    assert vae_slack(_rows([0.2, 0.2], reserved=False)) is None  # the CPU: nothing reserved, nothing measured
    assert vae_slack([{k: v for k, v in r.items() if k != "reserved_bytes"} for r in _rows([0.2])]) is None


def test_the_fit_carries_the_slack_only_where_it_was_measured():
    fit = fit_vae(_rows([0.15, 0.25, 0.2]), False, "test")
    assert fit["alloc_slack"] == pytest.approx(0.2, rel=1e-6)
    assert VaeDecodeFit(**fit).alloc_slack == pytest.approx(0.2, rel=1e-6)
    cpu = fit_vae(_rows([0.15, 0.25, 0.2], reserved=False), False, "test")
    assert "alloc_slack" not in cpu and VaeDecodeFit(**cpu).alloc_slack is None
    with pytest.raises(ValueError):
        VaeDecodeFit(**{**fit, "alloc_slack": -0.1})


def _estimates(hw: HardwareSpec, tiled: bool = False):
    spec = get_model("wan2.2")
    w = make_workload(spec, frames=81, height=704, width=1280, steps=4)
    point = transformer_candidates(Problem(spec, w, hw), 1.05, None).points[0]
    return spec, estimate(spec, w, hw, Placements(("phase",), "stream", "phase", tiled), point)


def _with_slack(hw: HardwareSpec, slack: float | None, tiled_slack: float | None = None) -> HardwareSpec:
    spec = get_model("wan2.2")
    fit = vae_fit(spec, hw)
    tiled = fit.tiled.model_copy(update={"alloc_slack": tiled_slack}) if fit.tiled is not None else None
    own = fit.model_copy(update={"alloc_slack": slack, "tiled": tiled})
    return hw.model_copy(update={"vae_decode": {**hw.pipeline.vae_decode, spec.pipeline.vae.name: own}})


@pytest.mark.parametrize("tiled", [False, True])
def test_the_decode_peak_holds_its_own_slack_and_no_other_phase_moves(tiled):
    _, profile = _estimates(H200, tiled)
    _, own = _estimates(_with_slack(H200, 0.05 if tiled else 0.2, 0.2 if tiled else 0.05), tiled)
    dec = own.phases["decode"]
    assert dec.alloc_slack == 0.2 and dec.activation_bytes > 0
    assert own.peak_memory("decode") == device_need(dec.allocated_bytes, dec.activation_bytes, H200, 0.2)
    assert own.peak_memory("decode") < profile.peak_memory("decode")  # 0.2 against the profile's 0.365
    held = (H200.alloc_slack - 0.2) * dec.activation_bytes * (1 + H200.reserve_fraction)
    assert profile.peak_memory("decode") - own.peak_memory("decode") == pytest.approx(held, abs=2)
    for name in ("encode", "denoise"):  # priced with the profile's figure as before
        assert own.peak_memory(name) == profile.peak_memory(name) and own.phases[name].alloc_slack is None


def test_a_measured_slack_stands_for_the_reserve_too():
    """On a profile with a reserve (calibrate keeps reserve_fraction 0.05): the VAE's measured slack is all the
    allocator held beyond the decode's peak, so the reserve is not added on top of it."""
    hw = get_hardware("h100-sxm")
    assert hw.reserve_fraction > 0
    _, own = _estimates(_with_slack(hw, 0.2))
    dec = own.phases["decode"]
    assert own.peak_memory("decode") == int(dec.allocated_bytes + 0.2 * dec.activation_bytes + hw.context_bytes)
    _, profile = _estimates(hw)
    assert profile.peak_memory("decode") == int((dec.allocated_bytes + hw.alloc_slack * dec.activation_bytes)
                                                * (1 + hw.reserve_fraction) + hw.context_bytes)


def test_a_fit_without_a_slack_is_priced_with_the_profiles():
    _, profile = _estimates(H200)
    _, none = _estimates(_with_slack(H200, None))
    assert none.phases["decode"].alloc_slack is None
    assert none.peak_memory("decode") == profile.peak_memory("decode")
    dec = profile.phases["decode"]
    assert profile.peak_memory("decode") == device_need(dec.allocated_bytes, dec.activation_bytes, H200)


def test_refit_keeps_a_vaes_own_slack_apart_and_refits_it(cli, workdir):
    """A tiny generation report made to look measured on a GPU, its denoise holding a known slack (0.4) and its
    decode another (0.9; the tiny encode has no activations to scale one): `calibrate --from-report` takes the
    profile's alloc_slack from the phases the profile's figure prices, so from both where the VAE's fit has no slack
    of its own (their median, 0.65) and from the denoise alone where it has (0.4); there the decode refits the
    fit's own (0.5 as calibrate measured it, 0.9 as run)."""
    import json
    from pathlib import Path

    from pipelines import one_thread

    from chunkflow.commands.calibrate.profile import profile_changes
    from chunkflow.commands.calibrate.refit import generation_estimate, read_reports, refit

    result = cli("plan", "--model", "tiny", "--hardware", "cpu", "--host-mem-budget", "8GB", "--out", "plan.json")
    assert result.exit_code == 0, result.output
    with one_thread():
        result = cli("run", "--plan", "plan.json", "--prompt", "a cat", "--report", "r.json")
    assert result.exit_code == 0, result.output
    hw = get_hardware("cpu")
    base = hw.model_copy(update={"alloc_slack": 0.0})
    e, _ = generation_estimate(read_reports(["r.json"])[0], base)
    data = json.loads(Path("r.json").read_text())
    data["gpu"], data["run"]["device"] = "NVIDIA H200", "cuda:0"
    held = {"encode": 0.2, "denoise": 0.4, "decode": 0.9}
    for name, ph in data["generation"]["phases"].items():
        ph["measured_peak_allocated_bytes"] = int(e.phases[name].allocated_bytes)
        ph["measured_peak_memory_bytes"] = int(e.phases[name].allocated_bytes + hw.context_bytes
                                               + held[name] * e.phases[name].activation_bytes)
    Path("r.json").write_text(json.dumps(data))
    reports = read_reports(["r.json"])
    shared, _ = refit(hw, reports)
    assert shared.alloc_slack == pytest.approx(0.65, rel=1e-3)
    own = _with_vae_slack(hw, get_model("tiny"), 0.5)  # as calibrate measured it; the runs held 0.9
    apart, notes = refit(own, reports)
    assert apart.alloc_slack == pytest.approx(0.4, rel=1e-3)
    e2, _ = generation_estimate(reports[0], apart)  # the decode's own slack refit from its decode: 0.9
    assert e2.phases["decode"].alloc_slack == pytest.approx(0.9, rel=1e-3)
    assert any("own allocator slack from 1 decode" in n for n in notes)
    assert any("allocator slack 0.5 -> 0.9" in c for c in profile_changes(own, apart))


def _with_vae_slack(hw: HardwareSpec, spec, slack: float) -> HardwareSpec:
    """`hw` with the fit of `spec`'s VAE (and its tiled one) holding `slack`."""
    fit = vae_fit(spec, hw)
    tiled = fit.tiled.model_copy(update={"alloc_slack": slack}) if fit.tiled is not None else None
    fit = fit.model_copy(update={"alloc_slack": slack, "tiled": tiled})
    return hw.model_copy(update={"vae_decode": {**hw.pipeline.vae_decode, spec.pipeline.vae.name: fit}})


def test_a_profile_with_the_vaes_slacks_round_trips_and_says_its_version(tmp_path):
    from chunkflow.commands.calibrate.profile import write_profile
    from chunkflow_planner.catalog import CATALOG_SCHEMA_VERSION, load_profile

    hw = _with_slack(H200, 0.21, 0.34)
    back = load_profile(write_profile(hw, tmp_path / "p.yaml"))
    fit = vae_fit(get_model("wan2.2"), back)
    assert back.schema_version == CATALOG_SCHEMA_VERSION == 10
    assert fit.alloc_slack == 0.21 and fit.tiled.alloc_slack == 0.34
