"""`calibrate --weights FOLDER` times the folder's own VAE where the catalog does not have it (issue 55: round 4's
decode peaks missed by 14% on PixArt-Sigma and SD3, whose VAEs are derived, so calibrate's measured decode slack
never reached them): the fit is kept under a name unique to that VAE's config, and plans of that folder price the
decode from it."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")

from pipelines import one_thread  # noqa: E402
from test_bad_input_5 import _allegro  # noqa: E402
from test_pipelines_53 import _pixart  # noqa: E402
from test_run_any import _cogvideox, _save, _sd3, derived  # noqa: E402

from chunkflow.commands.calibrate.measure import _vae_fits  # noqa: E402
from chunkflow_planner.catalog import VaeDecodeFit, Workload, get_hardware  # noqa: E402
from chunkflow_planner.pipeline.decode import decode_cost  # noqa: E402

CPU = types.SimpleNamespace(device=torch.device("cpu"), name="cpu")


def _fits(*folders: Path):
    """calibrate's VAE timing on the CPU (--cpu-smoke's sizes) with these folders (--weights, then --vae-weights):
    fits, raw rows, log."""
    lines: list[str] = []
    with one_thread():
        fits, raw, _ = _vae_fits(CPU, True, lambda what, n: (lambda: None), lines.append, [str(f) for f in folders])
    return fits, raw, lines


def test_a_derived_vae_is_named_by_its_config_so_two_folders_of_one_class_do_not_share_a_fit(workdir):
    pixart = _pixart(workdir / "pixart")
    sd3, _ = _sd3(workdir / "sd3")
    a = derived(pixart, height=32, width=32, steps=2).pipeline.vae
    again = derived(pixart, height=64, width=64, steps=3).pipeline.vae
    assert a.cls == sd3.pipeline.vae.cls == "AutoencoderKL"
    assert a.name == again.name and a.name.startswith("AutoencoderKL:derived-")
    assert sd3.pipeline.vae.name != a.name


def test_calibrate_times_the_folders_vae_and_its_plans_price_the_decode_from_that_fit(cli, workdir):
    from chunkflow.commands.calibrate.profile import write_profile

    pixart = _pixart(workdir / "pixart")
    name = derived(pixart, height=32, width=32, steps=2).pipeline.vae.name
    fits, raw, lines = _fits(pixart)
    assert set(fits) == {"tiny-wan-vae", name}  # the catalog's (the smoke run's one) and the folder's
    mine = [r for r in raw if r["vae"] == name]
    assert len(mine) >= 2 and all(r["time_s"] > 0 for r in mine)
    assert str(pixart) in fits[name]["source"] and any(name in line for line in lines)
    assert set(_fits()[0]) == {"tiny-wan-vae"}  # without --weights, the catalog's alone

    fit = VaeDecodeFit(**fits[name])
    hw = get_hardware("cpu")
    write_profile(hw.model_copy(update={"vae_decode": {**hw.pipeline.vae_decode, name: fit}}), "p.yaml")
    plans = {}
    for hardware in ("cpu", "p.yaml"):
        r = cli("plan", "--weights", pixart, "--hardware", hardware, "--height", "32", "--width", "32", "--steps",
                "2", "--json")
        assert r.exit_code == 0, r.output
        plans[hardware] = json.loads(r.stdout)
    spec = derived(pixart, height=32, width=32, steps=2)
    w = Workload(batch=1, frames=1, height=32, width=32, steps=2)
    timed = plans["p.yaml"]["prediction"]["phases"]["decode"]["parts_s"]["vae"]
    assert timed == pytest.approx(decode_cost(spec, w, get_hardware("p.yaml"), False)[0], rel=1e-9)
    assert timed != pytest.approx(plans["cpu"]["prediction"]["phases"]["decode"]["parts_s"]["vae"], rel=1e-3)
    shown = cli("plan", "--weights", pixart, "--hardware", "p.yaml", "--height", "32", "--width", "32", "--steps", "2")
    text = " ".join(shown.output.split())  # the console wraps its lines
    assert shown.exit_code == 0 and "vae (AutoencoderKL" not in text
    assert "Not timed by any calibration" in text and "the transformer's activations" in text  # still said


def test_a_video_vae_decodes_frames_and_one_that_decodes_only_tiled_is_fitted_from_its_tiled_decodes(workdir):
    cog, _ = _cogvideox(workdir / "cog")
    fits, raw, _ = _fits(workdir / "cog")
    rows = [r for r in raw if r["vae"] == cog.pipeline.vae.name and not r["tiled"]]
    assert {r["frames"] for r in rows} == {5, 9} and fits[cog.pipeline.vae.name]["time_per_voxel"] > 0

    allegro = _save(_allegro(), workdir / "allegro")
    vae = derived(allegro, height=32, width=32, frames=5, steps=2).pipeline.vae
    assert vae.tiled_only
    fits, raw, _ = _fits(allegro)
    assert {r["tiled"] for r in raw if r["vae"] == vae.name} == {True}
    fit = VaeDecodeFit(**fits[vae.name])
    assert fit.tiled is not None and fit.tiled.time_per_voxel == fit.time_per_voxel > 0


def test_a_plan_written_before_the_digest_reads_its_derived_vae_under_the_name_it_has_now(workdir):
    """Round 4's plans and reports say "AutoencoderKL:derived": read back, the VAE takes the name derive gives it now,
    so a profile's fit of that VAE prices them (docs/data/gpu-firstgen/reprice_decode.py); a catalog VAE keeps its
    name."""
    from chunkflow_planner.catalog import get_model
    from chunkflow_planner.components import VaeSpec

    vae = derived(_pixart(workdir / "pixart"), height=32, width=32, steps=2).pipeline.vae
    old = {**vae.model_dump(), "name": "AutoencoderKL:derived"}
    assert VaeSpec(**old).name == vae.name != old["name"]
    other = "bfloat16" if vae.dtype == "float32" else "float32"
    assert VaeSpec(**{**old, "dtype": other}).name != vae.name  # the dtype is part of it
    flux = get_model("flux").pipeline.vae
    assert VaeSpec(**flux.model_dump()).name == flux.name == "flux-vae"


def test_vae_weights_times_a_second_folders_vae_and_a_decode_that_fails_leaves_the_rest_timed(workdir, monkeypatch):
    """Round 4's two derived VAEs (PixArt's and SD3's) in one calibration: each folder's VAE gets its own fit. A
    folder's VAE that cannot decode at calibrate's sizes (out of memory on a GPU) is said not timed; the catalog's
    VAEs and the other folder's are still fitted. A catalog VAE's failure is chunkflow's own and still stops it."""
    import chunkflow.commands.calibrate.ops as ops

    pixart = _pixart(workdir / "pixart")
    sd3_folder = workdir / "sd3"
    sd3, _ = _sd3(sd3_folder)
    mine = derived(pixart, height=32, width=32, steps=2).pipeline.vae.name
    fits, _, _ = _fits(pixart, sd3_folder)
    assert set(fits) == {"tiny-wan-vae", mine, sd3.pipeline.vae.name}

    real = ops.measure_vae

    def out_of_memory_on(name):
        def measure(spec, *args, **kwargs):
            if spec.pipeline.vae.name == name:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 40.00 GiB")
            return real(spec, *args, **kwargs)
        return measure

    monkeypatch.setattr(ops, "measure_vae", out_of_memory_on(mine))
    fits, raw, lines = _fits(pixart, sd3_folder)
    assert set(fits) == {"tiny-wan-vae", sd3.pipeline.vae.name}
    assert not [r for r in raw if r["vae"] == mine]
    said = [line for line in lines if mine in line]
    assert said and "not timed" in said[0] and "OutOfMemoryError" in said[0] and str(pixart) in said[0]
    monkeypatch.setattr(ops, "measure_vae", out_of_memory_on("tiny-wan-vae"))
    with pytest.raises(torch.OutOfMemoryError):
        _fits(pixart)


def test_calibrate_vae_weights_puts_that_folders_vae_fit_in_the_profile(cli, workdir):
    from chunkflow_planner.catalog import load_profile

    pixart = _pixart(workdir / "pixart")
    name = derived(pixart, height=32, width=32, steps=2).pipeline.vae.name
    with one_thread():
        r = cli("calibrate", "--cpu-smoke", "--no-save", "--vae-weights", str(pixart), "--out", "p.yaml",
                "--startup-processes", "0")
    assert r.exit_code == 0, r.output
    fit = load_profile(workdir / "p.yaml").pipeline.vae_decode[name]
    assert fit.time_per_voxel > 0 and str(pixart) in fit.source


def test_calibrate_checks_every_vae_folder_before_measuring(cli, workdir):
    r = cli("calibrate", "--cpu-smoke", "--vae-weights", str(workdir / "nowhere"), "--out", "p.yaml")
    assert r.exit_code != 0 and "nowhere" in r.output and "Traceback" not in r.output
    assert not (workdir / "p.yaml").exists()
    r = cli("calibrate", "--from-report", "r.json", "--vae-weights", str(workdir))
    assert r.exit_code != 0 and "--vae-weights" in r.output and "Traceback" not in r.output
